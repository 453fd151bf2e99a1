"""Counting the Redis round trips clients make, by command and by tokenmill script (diagnostics).

A :class:`TripCounter` watches a Redis server through ``MONITOR`` on a thread of its own and
counts what clients send: each command is one round trip, except that a ``MULTI`` ... ``EXEC``
block (kombu's bookkeeping of unacked messages) counts once, as ``multi/exec``; commands a Lua
script runs inside the server are not round trips and are left out. ``EVALSHA`` and ``EVAL``
are counted by the tokenmill script they run (``evalsha:claim``). Used by ``bench/jobcost.py``
and by the test that bounds a job's round trips. MONITOR slows Redis down: count, do not time.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections import Counter

import redis

from tokenmill.transitions import SCRIPT_NAMES, script_source

_SHAS = {hashlib.sha1(script_source(n).encode()).hexdigest(): n for n in SCRIPT_NAMES}


class TripCounter:
    """Round trips sent to one Redis server while the counter runs (a context manager)."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url)
        self._end = f"tokenmill-trips-end-{uuid.uuid4().hex}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trip-counter", daemon=True)
        self.counts: Counter[str] = Counter()
        self.by_conn: dict[str, Counter[str]] = {}  # the same counts by client "address:port"
        self._error: BaseException | None = None

    def __enter__(self) -> TripCounter:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("MONITOR did not start")
        return self

    def __exit__(self, *_: object) -> None:
        self._client.echo(self._end)
        self._thread.join(30)
        if self._error is not None:
            raise self._error
        # the counter's own marker is not counted, and neither is what the caller sent to stop it
        self.counts["echo"] -= 1
        self.counts = +self.counts

    def _run(self) -> None:
        in_multi: set[str] = set()
        try:
            with self._client.monitor() as mon:
                self._ready.set()
                while True:
                    entry = mon.next_command()
                    if entry["client_type"] == "lua":
                        continue
                    words = entry["command"].split(" ", 2)
                    name = words[0].lower()
                    conn = f"{entry['client_address']}:{entry['client_port']}"
                    if name == "echo" and len(words) > 1 and words[1] == self._end:
                        self.counts["echo"] += 1
                        return
                    if name == "multi":
                        in_multi.add(conn)
                        continue
                    if conn in in_multi:
                        if name in ("exec", "discard"):
                            in_multi.discard(conn)
                            self._count(conn, "multi/exec")
                        continue
                    if name in ("evalsha", "eval") and len(words) > 1:
                        sha = words[1] if name == "evalsha" else hashlib.sha1(words[1].encode()).hexdigest()
                        name = f"evalsha:{_SHAS.get(sha.lower(), sha[:8])}"
                    self._count(conn, name)
        except BaseException as exc:  # reported by __exit__
            self._error = exc
            self._ready.set()

    def _count(self, conn: str, name: str) -> None:
        self.counts[name] += 1
        self.by_conn.setdefault(conn, Counter())[name] += 1

    def total(self) -> int:
        return sum(self.counts.values())
