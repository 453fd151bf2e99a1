"""The upkeep: in every worker, one at a time under a Redis lock, every ``reaper_period_s``.

It requeues jobs whose lease expired (a killed worker's jobs run again within about one lease
TTL plus one period, whatever the broker's visibility timeout), publishes delayed retries
whose time has come, tops the broker lists up from the backlog, republishes queued jobs
that no message carries (see :class:`Reconciler`), these three for runs that are not paused,
and adds each run's point to its history once a ``series_step_s`` (:mod:`tokenmill.history`).
"""

from __future__ import annotations

import logging
import threading

import redis

from tokenmill import history, keys
from tokenmill.ledger import Ledger
from tokenmill.replies import text
from tokenmill.series import SeriesWriter
from tokenmill.settings import Settings
from tokenmill.transitions import F

log = logging.getLogger("tokenmill.pump")


class Reconciler:
    """Finds ``queued`` jobs that no message carries (after a Redis crash or a flushed queue).

    When every broker list is empty, every message that still exists is in a worker's hands,
    and such a job is running or about to be claimed. A job found ``queued`` (not delayed, not
    on the backlog) in two passes in a row with the brokers empty both times has no message:
    it is republished. Duplicates this might create are no-ops by construction.
    """

    def __init__(self) -> None:
        self.suspects: dict[str, set[str]] = {}

    def pass_(self, client: redis.Redis, ledger: Ledger) -> int:
        counts = {} if any(client.llen(keys.broker_queue(q)) for q in keys.QUEUES) else ledger.counts()
        if not any(c["queued"] for c in counts.values()):
            self.suspects.pop(ledger.run, None)
            return 0
        parked = ledger.parked()
        queued = {
            job_id
            for partition, c in counts.items()
            if c["queued"]
            for job_id, (state,) in ledger.iter_jobs(partition, (F.STATE,))
            if state == b"queued" and job_id not in parked
        }
        orphans = queued & self.suspects.get(ledger.run, set())
        self.suspects[ledger.run] = queued - orphans
        if orphans:
            log.warning("run %s: %d queued job(s) had no message; republished", ledger.run, len(orphans))
            return ledger.republish(sorted(orphans)).published
        return 0


def upkeep_once(
    client: redis.Redis, settings: Settings, reconciler: Reconciler, recorder: SeriesWriter | None = None
) -> dict[str, int]:
    """One pass over every run with unfinished jobs; returns what it did. With ``recorder``,
    each run's history gets its point when one is due (:mod:`tokenmill.history`)."""
    did = {"reaped": 0, "promoted": 0, "abandoned": 0, "fed": 0, "republished": 0, "recorded": 0}
    for raw in client.smembers(keys.runs()):
        run = text(raw)
        ledger = Ledger(client, run)
        reaped = ledger.reap_expired()
        if reaped:
            log.warning("run %s: requeued %d job(s) whose lease expired", run, len(reaped))
        did["reaped"] += len(reaped)
        did["abandoned"] += ledger.requeue_abandoned()
        if client.exists(ledger.k.paused()):
            # a paused run's jobs stay where they are: nothing is published for them (a
            # reaped or abandoned job's message is acked by the worker it reaches)
            reconciler.suspects.pop(run, None)
        else:
            did["promoted"] += ledger.promote_due()
            for queue in keys.QUEUES:
                did["fed"] += ledger.feed_backlog(queue, settings.max_queued)
            did["republished"] += reconciler.pass_(client, ledger)
        if recorder is not None:
            try:  # a failure to record never stops the upkeep's work
                did["recorded"] += history.record_run(recorder, client, run)
            except redis.ResponseError as exc:
                log.warning("run %s: history point not recorded: %s", run, exc)
    return did


class Upkeep(threading.Thread):
    """The upkeep's thread: takes the lock without blocking; whoever holds it does the pass."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        super().__init__(name="tokenmill-upkeep", daemon=True)
        self.r = client
        self.settings = settings
        self.stop_event = threading.Event()
        self.reconciler = Reconciler()
        self.recorder = SeriesWriter(client, settings.series_step_s, settings.series_keep_s)
        # A worker killed during its pass leaves the lock held until it expires: never later than
        # a lease, or the killed worker's own jobs, their leases expired, would wait for it (a
        # 10 s lock over 4 s leases held them 10.6 s in a chaos test). A pass that outlasts the
        # lock may overlap the next holder's; every step of a pass is atomic on its own.
        period = settings.reaper_period_s
        self.lock = client.lock(
            keys.upkeep_lock(), timeout=min(max(2 * period, 10), settings.lease_ttl_s), blocking=False
        )

    def run(self) -> None:
        while not self.stop_event.wait(self.settings.reaper_period_s):
            try:
                if self.lock.acquire(blocking=False):
                    try:
                        upkeep_once(self.r, self.settings, self.reconciler, self.recorder)
                    finally:
                        self.lock.release()
            except redis.RedisError as exc:
                log.warning("upkeep pass skipped: %s", exc)
            except Exception:
                log.exception("upkeep pass failed")

    def stop(self) -> None:
        self.stop_event.set()
