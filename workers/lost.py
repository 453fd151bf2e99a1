"""Streams the server no longer holds: it was restarted, or its host vanished and a replacement
answers at its address, while this process's connections to the old one stay open and silent.

Nothing closes such a stream (a vanished host sends no reset), so only its stall deadline
(``stall_timeout_s``, 120 s) would end it; meanwhile it holds a worker thread and an admission
slot, and the queued jobs wait behind it. SGLang (0.5.23) states no identity of its instance
(``/server_info``'s ``startup_time`` is a dict of durations; its ``random_seed`` is the user's
when set), so the rule reads what the server says it holds: ``/v1/loads``, which the scheduler
publishes at every prefill, at once when it goes idle, and every few decode steps. A request
there is running (decoding: a chunk every step), waiting (queued, retracted), or prefilling,
which holds KV tokens; so a server that reports no running and no waiting request and no KV
token in use holds none of them, and a request it lost never comes back.

When a stream has heard nothing for ``QUIET_S`` the watch reads its server's load at every
tick, off the loop; a failed read forgets the readings, so a server that cannot be reached never
triggers it. A ``/v1/loads`` costs SGLang's front end ~1 ms (a tenth of a ``/metrics`` page,
:mod:`workers.loadwatch`), read only while a stream is silent that long. The process that finds
the server idle over the quiet span says since when in Redis (``keys.server_idle``): another
process's streams silent since before then are lost too, even if by its own reads the server is
already busy again with the first one's retried jobs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Generic, NamedTuple, TypeVar

import redis

from tokenmill import keys, server_report
from tokenmill.server_report import Load
from tokenmill.url_secrets import split_userinfo

log = logging.getLogger("tokenmill.worker")
QUIET_S = 5.0  # a stream silent this long, on a server that holds nothing this long, is lost
READ_TIMEOUT_S = 1.0
SKEW_S = 1.0  # another host's clock may be this far off: its finding covers streams silent before
SHARED_TTL_MS = 60_000
T = TypeVar("T")


class Reading(NamedTuple):
    at: float  # when it was read (the watch's clock)
    load: Load


class Heard(NamedTuple, Generic[T]):
    """A stream in flight: when it last received anything, and whether a chunk ever came."""

    stream: T
    heard_at: float  # its last chunk, else when it was sent
    answered: bool


def quiet_span(readings: Sequence[Reading], now: float, quiet_s: float) -> Sequence[Reading]:
    """The readings over the last ``quiet_s`` and the one before them (none: not read that long
    since the last failed read). ``readings`` come one after another, oldest first."""
    for i in range(len(readings) - 1, -1, -1):
        if readings[i].at <= now - quiet_s:
            return readings[i:]
    return ()


def idle_since(readings: Sequence[Reading], now: float, quiet_s: float) -> float | None:
    """When the quiet span began, if the server held nothing (no running or waiting request, no
    KV token in use: no prefill) in every reading over it."""
    seen = quiet_span(readings, now, quiet_s)
    if seen and all(r.load.running == r.load.waiting == r.load.used_tokens == 0 for r in seen):
        return seen[0].at
    return None


def lost(
    readings: Sequence[Reading],
    streams: Sequence[Heard[T]],
    now: float,
    quiet_s: float,
    idle_at: float | None = None,
) -> list[T]:
    """The streams a server does not hold, by its loads this process read and what the streams
    received (``idle_at``: since when another process found it idle over a quiet span).

    A stream that heard anything in the last ``quiet_s`` is never lost. One silent since before
    the server was found idle is. Otherwise, while anything waits on the server none is (a
    queued or retracted request hears nothing); but when over the quiet span the server ran
    fewer requests than there are silent streams that had been answered (a decoding request
    hears a chunk every step), it lacks some of those: they are all lost."""
    seen = quiet_span(readings, now, quiet_s)
    proven = max(idle_since(readings, now, quiet_s) or -1.0, idle_at or -1.0)
    gone = [s.stream for s in streams if s.heard_at <= proven]  # silent since before the span
    if gone or not seen or any(r.load.waiting for r in seen):
        return gone
    answered = [s.stream for s in streams if s.answered and s.heard_at <= seen[0].at]
    return answered if len(answered) > max(r.load.running for r in seen) else []


class LostStreams(Generic[T]):
    """The loads of the servers a process has silent streams to, and the streams they show lost.
    Called at each watch tick, on the loop; the reads (of the server and of Redis) run on
    threads."""

    def __init__(self, api_key: str | None, client: redis.Redis | None) -> None:
        self.api_key = api_key
        self.redis = client
        self.readings: dict[str, list[Reading]] = {}
        self.shared: dict[str, float] = {}  # server -> since when another process found it idle
        self._reading: set[str] = set()

    def check(self, now: float, streams: dict[str, list[Heard[T]]]) -> list[T]:
        """The streams lost, by server root URL; start the reads that are due."""
        out: list[T] = []
        for server in set(self.readings) - set(streams):
            del self.readings[server]
        for server, heard in streams.items():
            if not any(now - h.heard_at >= QUIET_S for h in heard):
                self.readings.pop(server, None)
                continue
            readings = self.readings.setdefault(server, [])
            while len(readings) > 1 and readings[1].at <= now - QUIET_S:
                del readings[0]  # the one at or before the span's start is the oldest needed
            shared = self.shared.pop(server, None)
            idle_at = None if shared is None else shared - (time.time() - now) - SKEW_S
            out += lost(readings, heard, now, QUIET_S, idle_at)
            since = idle_since(readings, now, QUIET_S)
            if since is not None and self.redis is not None:
                wall_ms = int((since + time.time() - now) * 1000)
                asyncio.get_running_loop().run_in_executor(None, self._tell, server, wall_ms)
            if server not in self._reading:
                self._read(server)
        return out

    def _read(self, server: str) -> None:
        loop = asyncio.get_running_loop()
        self._reading.add(server)
        read = asyncio.ensure_future(asyncio.to_thread(self._fetch, server))

        def done(fut: asyncio.Future[tuple[Load, float | None]]) -> None:
            self._reading.discard(server)
            if fut.cancelled() or fut.exception() is not None:
                self.readings.pop(server, None)  # unreachable: the span starts again
                return
            load, shared = fut.result()
            if server in self.readings:
                self.readings[server].append(Reading(loop.time(), load))
            if shared is not None:
                self.shared[server] = shared

        read.add_done_callback(done)

    def _fetch(self, server: str) -> tuple[Load, float | None]:
        """The server's load, and since when another process found it idle (epoch s)."""
        load = server_report.loads(server, self.api_key, READ_TIMEOUT_S)
        try:
            said = self.redis.get(keys.server_idle(_identity(server))) if self.redis else None
        except redis.RedisError:
            said = None
        return load, int(said) / 1000 if said else None

    def _tell(self, server: str, wall_ms: int) -> None:
        assert self.redis is not None
        try:
            self.redis.set(keys.server_idle(_identity(server)), wall_ms, px=SHARED_TTL_MS)
        except redis.RedisError as exc:
            log.debug("could not share that %s holds nothing: %s", _identity(server), exc)


def _identity(server: str) -> str:
    """The server's root URL without credentials."""
    return split_userinfo(server)[0]
