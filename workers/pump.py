"""The pump: in every worker, one at a time under a Redis lock, every ``reaper_period_s``.

It requeues jobs whose lease expired (a killed worker's jobs run again within about one lease
TTL plus one period, whatever the broker's visibility timeout), publishes delayed retries
whose time has come, and tops the broker lists up from the backlog.
"""

from __future__ import annotations

import logging
import threading

import redis

from tokenmill import keys
from tokenmill.ledger import Ledger
from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.pump")


def pump_once(client: redis.Redis, settings: Settings) -> dict[str, int]:
    """One pass over every run with unfinished jobs; returns what it did."""
    did = {"reaped": 0, "promoted": 0, "fed": 0}
    for raw in client.smembers(keys.runs()):
        run = raw.decode()
        ledger = Ledger(client, run)
        reaped = ledger.reap_expired()
        if reaped:
            log.warning("run %s: requeued %d job(s) whose lease expired", run, len(reaped))
        did["reaped"] += len(reaped)
        did["promoted"] += ledger.promote_due()
        for queue in keys.QUEUES:
            did["fed"] += ledger.feed_backlog(queue, settings.max_queued)
    return did


class Pump(threading.Thread):
    """The pump's thread: takes the lock without blocking; whoever holds it does the pass."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        super().__init__(name="tokenmill-pump", daemon=True)
        self.r = client
        self.settings = settings
        self.stop_event = threading.Event()

    def run(self) -> None:
        period = self.settings.reaper_period_s
        lock = self.r.lock(keys.pump_lock(), timeout=max(2 * period, 10), blocking=False)
        while not self.stop_event.wait(period):
            try:
                if lock.acquire(blocking=False):
                    try:
                        pump_once(self.r, self.settings)
                    finally:
                        lock.release()
            except redis.RedisError as exc:
                log.warning("pump pass skipped: %s", exc)
            except Exception:
                log.exception("pump pass failed")

    def stop(self) -> None:
        self.stop_event.set()
