"""The servers a worker may send work to, and whether each is ready.

A server published by a server manager (``tokenmill.servers``) is ready when its state is
``ready``. A server nobody manages is presumed ready until a request to it fails; then it is
probed on ``/health`` (200 after warmup; never ``/v1/models``) until it answers again. While no
server is ready, workers wait instead of failing jobs or burning retries.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import redis

from tokenmill import capacity, server_report
from tokenmill import servers as server_records
from tokenmill.settings import Settings
from tokenmill.url_secrets import redact_url

log = logging.getLogger("tokenmill.pool")

HEALTH_TIMEOUT_S = 25.0  # a wedged SGLang /health answers 503 after 20 s
RECORDS_TTL_S = 1.0
CAPACITY_RETRY_S = 10.0
CAPACITY_TIMEOUT_S = 10.0


@dataclass(slots=True)
class ServerView:
    url: str
    name: str
    capacity: int | None = None
    managed: bool = False


class ServerPool:
    """Readiness of ``settings.server_urls``, shared by a worker's threads."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.r = client
        self._lock = threading.Lock()
        self._suspect: dict[str, float] = {}  # url -> when it was last found unhealthy
        self._records: dict[str, server_records.ServerRecord] = {}
        self._records_at = 0.0
        self._capacities: dict[str, tuple[float, int | None]] = {}

    def _load_records(self) -> dict[str, server_records.ServerRecord]:
        now = time.monotonic()
        if now - self._records_at > RECORDS_TTL_S:
            try:
                recs = server_records.load_all(self.r)
            except redis.RedisError:
                recs = []
            self._records = {rec.url.rstrip("/"): rec for rec in recs}
            self._records_at = now
        return self._records

    def _ready(self, records: dict[str, server_records.ServerRecord], fetch: bool) -> list[ServerView]:
        """The ready servers; with ``fetch``, an unmanaged server's capacity is read when due."""
        out = []
        for url in self.settings.server_urls:
            rec = records.get(url)
            if rec is not None:
                if rec.state == server_records.READY:
                    out.append(ServerView(url, rec.name, rec.max_total_num_tokens, managed=True))
            elif url not in self._suspect:
                if fetch and self._capacity_due(url, time.monotonic()):  # read from /server_info
                    self._capacities[url] = (time.monotonic(), self._fetch_capacity(url))
                cap = self._capacities.get(url, (0.0, None))[1]
                out.append(ServerView(url, server_records.name_of(url), cap))
        return out

    def _capacity_due(self, url: str, now: float) -> bool:
        """Whether ``url``'s capacity is to be read: never read, or unknown for a while."""
        cached = self._capacities.get(url)
        return cached is None or (cached[1] is None and now - cached[0] > CAPACITY_RETRY_S)

    def _fetch_capacity(self, url: str) -> int | None:
        """``/server_info``'s KV pool; sglang-router's (which states none) is its workers' pools
        summed from its ``/engine_metrics`` (:func:`tokenmill.server_report.loads`)."""
        key = self.settings.api_key
        try:
            total = capacity.fetch(url, key, CAPACITY_TIMEOUT_S).max_total_num_tokens
            return total if total is not None else server_report.loads(url, key, CAPACITY_TIMEOUT_S).capacity
        except (OSError, ValueError) as exc:
            shown = redact_url(url)
            log.warning("server %s: /server_info failed (%s); its capacity is unknown for now", shown, exc)
            return None

    def ready_views_now(self) -> list[ServerView] | None:
        """The ready servers as this process last read them, or None when telling would read
        Redis or a server (the records or a capacity are due for a refresh): for the event loop,
        where nothing may wait."""
        now = time.monotonic()
        if now - self._records_at > RECORDS_TTL_S:
            return None
        if any(
            self._capacity_due(url, now)
            for url in self.settings.server_urls
            if url not in self._records and url not in self._suspect
        ):
            return None
        return self._ready(self._records, fetch=False)

    def ready_views(self) -> list[ServerView]:
        """Every ready server (probing suspects when none is)."""
        ready = self._ready(self._load_records(), fetch=True)
        if ready:
            return ready
        with self._lock:
            suspects = list(self._suspect)
        for url in suspects:
            if probe_health(url)[0]:
                log.warning("server %s answers /health again", redact_url(url))
                self._suspect.pop(url, None)
        return self._ready(self._load_records(), fetch=True)

    def is_down(self, url: str) -> bool:
        """After a failed request: is the server down (rather than the request at fault)?

        Its own ``/health`` answers first (a manager may not have noticed a crash yet); a managed
        server that answers is still down unless its manager says ``ready``.
        """
        found = self._suspect.get(url)
        if found is not None and time.monotonic() - found < HEALTH_TIMEOUT_S:
            return True  # another stream's probe found it down just now: a probe would wait as long
        ok, reason = probe_health(url)
        if ok:
            self._suspect.pop(url, None)
            self._records_at = 0.0
            rec = self._load_records().get(url)
            return rec is not None and rec.state != server_records.READY
        if url not in self._suspect:
            what = f"GET /health {reason}"
            log.warning("server %s is down or not SGLang: %s; its jobs wait for it", redact_url(url), what)
        self._suspect[url] = time.monotonic()
        return True

    def found_down(self, url: str) -> bool:
        """Whether ``url`` failed its health check and has not answered since (any thread)."""
        return url in self._suspect


def probe_health(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> tuple[bool, str]:
    """Whether ``GET {url}/health`` answers 200, and what it answered otherwise."""
    try:
        with urllib.request.urlopen(capacity.request(f"{url}/health"), timeout=timeout_s) as resp:
            return resp.status == 200, f"answered {resp.status}"
    except urllib.error.HTTPError as exc:
        hint = " (is this an SGLang server? it has no /health)" if exc.code == 404 else ""
        return False, f"answered {exc.code}{hint}"
    except OSError as exc:  # (a URLError, a TimeoutError)
        return False, f"failed: {getattr(exc, 'reason', exc)}"
