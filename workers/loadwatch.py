"""The closed loop's eyes: one worker at a time reads each server's load and steers its window.

Every ``admission_poll_s`` each worker process tries to hold a short Redis lease per server
(``keys.admission_watch``); the holder reads the server's ``/v1/loads`` (running, waiting, KV
used, capacity) and its retractions so far, and hands them to ``Admission.adapt``. Any number
of worker processes on any number of hosts, and still one reader per server: the server is not
polled once per worker, and the window moves once per reading. When the holder dies, its lease
lapses after three polls and another worker takes over; until then the window goes stale and
admission falls back to its token budget.

Retractions: a managed server's manager counts them from the server's log (``live.retractions``
of its record); an unmanaged one is read from ``/metrics`` when it serves one. Behind
sglang-router both reads go to the router's ``/engine_metrics``, its workers' figures summed
(:mod:`tokenmill.server_report`). A page of ``/metrics`` costs the server's front end ~10 ms of
CPU on SGLang 0.5.23 (ten times a ``/v1/loads``), taken from the core it may share with the
scheduler, so it is read at every poll only while a retraction may just have happened (requests
wait on the server, or its KV use is near full, in these figures or the last) and every
``METRICS_EVERY_S`` otherwise (:class:`MetricsCadence`); the count is cumulative, so a skipped
read delays a retraction's news, it does not lose it.

The holder also adds the server's point to its history once a ``series_step_s``: what it read
and the window it set (:mod:`tokenmill.history`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

import redis

from tokenmill import history, keys, server_report
from tokenmill import servers as server_records
from tokenmill.replies import text
from tokenmill.series import SeriesWriter
from tokenmill.server_report import Load
from workers.runtime import Runtime

log = logging.getLogger("tokenmill.worker")
METRICS_RETRY_S = 60.0  # a server without /metrics is asked again after this long
METRICS_EVERY_S = 2.0  # an unmanaged server's /metrics, while no retraction can have happened
TIGHT_USE = 0.9  # KV use (of the pool) from which a retraction may be near


class _Read(NamedTuple):
    at: float  # monotonic seconds
    retractions: int
    tight: bool  # the figures it was read with said a retraction may be near


class MetricsCadence:
    """When the load watch reads an unmanaged server's ``/metrics`` for its retraction count.

    SGLang retracts requests when its KV pool cannot hold the next decode step: the pool is full
    then, and the retracted requests wait in its queue after. So a retraction may have happened
    since the last figures only if these or the last showed requests waiting or KV use at
    :data:`TIGHT_USE` of the pool or more; otherwise the count read within :data:`METRICS_EVERY_S` stands."""

    def __init__(self) -> None:
        self._last: dict[str, _Read] = {}

    def tight(self, load: Load) -> bool:
        return load.waiting > 0 or (load.capacity > 0 and load.used_tokens >= TIGHT_USE * load.capacity)

    def cached(self, url: str, load: Load, now: float) -> int | None:
        """The retractions last read from ``url``, if these figures need no fresh read; else None."""
        last = self._last.get(url)
        if last is None or last.tight or self.tight(load) or now - last.at >= METRICS_EVERY_S:
            return None
        return last.retractions

    def read(self, url: str, load: Load, now: float, retractions: int) -> None:
        self._last[url] = _Read(now, retractions, self.tight(load))


class LoadWatch(threading.Thread):
    """Reads the servers this worker may use and steers their admission windows."""

    def __init__(self, rt: Runtime) -> None:
        super().__init__(name="tokenmill-loadwatch", daemon=True)
        self.rt = rt
        self._no_metrics: dict[str, float] = {}  # url -> when /metrics was found missing
        self._failing: set[str] = set()
        self.cadence = MetricsCadence()
        s = rt.settings
        self.recorder = SeriesWriter(rt.redis, s.series_step_s, s.series_keep_s)

    def run(self) -> None:
        s = self.rt.settings
        while not self.rt.stopping.wait(s.admission_poll_s):
            try:
                for view in self.rt.pool.ready_views():
                    if self._lead(view.name):
                        self._read(view.name, view.url, view.managed)
            except redis.RedisError as exc:
                log.debug("load watch: Redis unavailable (%s)", exc)

    def _lead(self, server: str) -> bool:
        """Take or keep this server's watch lease (three polls long)."""
        key = keys.admission_watch(server)
        ttl_ms = int(self.rt.settings.admission_poll_s * 3000)
        r, me = self.rt.redis, self.rt.worker_id
        if r.set(key, me, nx=True, px=ttl_ms):
            return True
        holder = r.get(key)
        if holder is not None and text(holder) == me:
            r.pexpire(key, ttl_ms)
            return True
        return False

    def _read(self, server: str, url: str, managed: bool) -> None:
        s = self.rt.settings
        timeout = max(1.0, s.admission_poll_s * 2)
        try:
            load = server_report.loads(url, s.api_key, timeout)
        except (OSError, ValueError) as exc:
            if url not in self._failing:
                log.warning(
                    "load watch: %s gave no load figures (%s); admission uses its budget", server, exc
                )
                self._failing.add(url)
            return
        self._failing.discard(url)
        retractions = self._retractions(server, url, managed, load, timeout)
        window = self.rt.admission.adapt(server, load, retractions)
        history.record_server(self.recorder, self.rt.redis, server, load, window, retractions)

    def _retractions(self, server: str, url: str, managed: bool, load: Load, timeout: float) -> int | None:
        """The server's retractions so far, or None when it does not say."""
        if managed:  # its manager reads every line of its log: no retraction line yet means none
            record = server_records.load(self.rt.redis, server)
            return int(record.live.get("retractions", 0)) if record else None
        now = time.monotonic()
        missing_since = self._no_metrics.get(url)
        if missing_since is not None and now - missing_since < METRICS_RETRY_S:
            return None
        cached = self.cadence.cached(url, load, now)
        if cached is not None:
            return cached
        try:
            figures = server_report.metrics(url, timeout, self.rt.settings.api_key)
        except (OSError, ValueError):  # (an HTTPError is an OSError)
            self._no_metrics[url] = now
            return None
        self._no_metrics.pop(url, None)
        retractions = int(figures.get("retractions", 0))  # the counter appears with the first retraction
        self.cadence.read(url, load, now, retractions)
        return retractions
