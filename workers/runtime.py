"""A worker process's shared parts: settings, Redis, the event loop, HTTP clients, servers."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import httpx2
from openai import AsyncOpenAI, DefaultAioHttpClient

from tokenmill import redis_conn
from tokenmill.admission import Admission
from tokenmill.ledger import AsyncHeartbeat, Ledger
from tokenmill.settings import Settings
from workers.loop import LoopThread
from workers.pool import ServerPool
from workers.watch import Watch

log = logging.getLogger("tokenmill.worker")


class Runtime:
    """Built once per worker process, on first use."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.redis = redis_conn.connect(settings)
        self.loop = LoopThread(settings.event_loop)
        self.pool = ServerPool(settings, self.redis)
        self.admission = Admission(self.redis, settings)
        self.stopping = threading.Event()  # stop taking work
        self.abort_streams = threading.Event()  # grace period over: checkpoint and release
        self.auth_error: str | None = None
        self._ledgers: dict[str, Ledger] = {}
        self._clients: dict[str, AsyncOpenAI] = {}
        self._lock = threading.Lock()
        self.watch = Watch(settings, self.loop.run(self._make_heartbeat()), self.abort_streams)
        self.inflight = 0

    async def _make_heartbeat(self) -> AsyncHeartbeat:
        return AsyncHeartbeat(redis_conn.connect_async(self.settings))

    def ledger(self, run: str) -> Ledger:
        with self._lock:
            if run not in self._ledgers:
                self._ledgers[run] = Ledger(self.redis, run)
            return self._ledgers[run]

    def client(self, url: str) -> AsyncOpenAI:
        """The openai client for ``url``, created on the loop (its aiohttp session lives there)."""
        with self._lock:  # held while creating: the first jobs all arrive at once
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = self.loop.run(self._make_client(url))
        return client

    async def _make_client(self, url: str) -> AsyncOpenAI:
        s = self.settings
        # No read timeout: the watchdog enforces each request's stall and total deadlines, and
        # aiohttp would cancel and re-arm a timer on every chunk (bench/e2e.py --per-token).
        timeout = httpx2.Timeout(None, connect=s.connect_timeout_s)
        # Explicit: with None, openai's aiohttp transport keeps aiohttp's default cap of 100
        # connections, and a 150-thread worker streamed only 100 requests at once.
        limits = httpx2.Limits(max_connections=4096, max_keepalive_connections=1024)
        return AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key=s.api_key or "EMPTY",
            max_retries=0,
            timeout=timeout,
            http_client=DefaultAioHttpClient(timeout=timeout, limits=limits),
        )


_runtime: dict[str, Runtime] = {}
_runtime_lock = threading.Lock()


def get_runtime(settings_factory: Any) -> Runtime:
    """The process's runtime, built on first use from ``settings_factory()``."""
    with _runtime_lock:
        if "rt" not in _runtime:
            _runtime["rt"] = Runtime(settings_factory())
        return _runtime["rt"]


def current() -> Runtime | None:
    return _runtime.get("rt")
