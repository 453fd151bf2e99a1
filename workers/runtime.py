"""A worker process's shared parts: settings, Redis, the event loop, HTTP clients, servers."""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from tokenmill import ledger_async, redis_conn
from tokenmill.ledger_async import AsyncLedger
from tokenmill.quality import LengthBounds
from tokenmill.redis_async import LoopRedis
from tokenmill.settings import Settings
from workers.admission import affinity
from workers.admission.limiter import Admission
from workers.event_loop import LoopThread
from workers.pool import ServerPool
from workers.reference import Scorer
from workers.stream import StreamClient
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
        self.homes = affinity.Homes()  # where this process admitted each prefix key lately
        self.prefills = affinity.Prefills()  # prefix keys whose first job has no token yet
        self.stopping = threading.Event()  # stop taking work
        self.abort_streams = threading.Event()  # grace period over: checkpoint and release
        self.auth_error: str | None = None
        # quality (workers.job_path): each run's usual completion lengths, (read at, bounds) by
        # the loop's clock; and the pause this process last said it saw, run -> since (ms)
        self.length_bounds: dict[str, tuple[float, LengthBounds | None]] = {}
        self.pauses_said: dict[str, str] = {}
        self.redis_async = LoopRedis(
            settings.redis_url, name=f"tokenmill-loop:{self.worker_id}", scripts=ledger_async.SCRIPTS.values()
        )
        self.async_ledger = AsyncLedger(self.redis_async)  # the ledger's transitions, on the loop
        self._clients: dict[str, StreamClient] = {}
        self._lock = threading.Lock()
        self.watch = Watch(
            settings,
            self.async_ledger,
            self.abort_streams,
            self.pool.found_down,
            self.redis,
        )
        for url in settings.server_urls:  # built now, not on the loop under the first job
            self.client(url)
        self.reference = Scorer(self.redis, settings)  # started with the upkeep (workers/task.py)

    def client(self, url: str) -> StreamClient:
        """The stream client for ``url``, one per server per process (its connections are kept
        alive and shared by every stream of the process, on the loop)."""
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                s = self.settings
                client = self._clients[url] = StreamClient(
                    url, s.api_key, s.connect_timeout_s, answer_timeout_s=s.stall_timeout_s
                )
        return client


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
