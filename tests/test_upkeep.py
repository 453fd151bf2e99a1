"""The upkeep: reaper, delayed retries, backlog feeding, and reconciliation with the broker."""

from __future__ import annotations

import time

import redis

from tests.procs import wait_for
from tests.test_ledger import spec
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.settings import Settings
from tokenmill.transitions import Claim
from workers.upkeep import Reconciler, Upkeep, upkeep_once


def test_queued_jobs_that_lost_their_messages_are_republished(rclient: redis.Redis) -> None:
    # Given a run whose broker list was lost (a Redis crash, a flushed queue)
    ledger = Ledger(rclient, "r1")
    jobs = [spec(i) for i in range(5)]
    ledger.call(t.enqueue(ledger.k, "P", jobs, 100))
    done = ledger.call(t.claim(ledger.k, jobs[0].job_id, "w", 30))
    assert isinstance(done, Claim)
    ledger.call(t.commit(ledger.k, done, {"content": "x"}, 0))
    rclient.delete("short")
    settings = Settings.load(env={})
    rec = Reconciler()

    # When the upkeep passes twice, then a third time
    first = upkeep_once(rclient, settings, rec)
    second = upkeep_once(rclient, settings, rec)
    third = upkeep_once(rclient, settings, rec)

    # Then the 4 queued jobs are republished once (the first pass only suspects them)
    assert first["republished"] == 0 and second["republished"] == 4 and third["republished"] == 0
    assert rclient.llen("short") == 4


def test_nothing_is_republished_while_messages_are_in_the_broker(rclient: redis.Redis) -> None:
    ledger = Ledger(rclient, "r1")
    ledger.call(t.enqueue(ledger.k, "P", [spec(i) for i in range(3)], 100))
    settings = Settings.load(env={})
    rec = Reconciler()
    for _ in range(3):
        assert upkeep_once(rclient, settings, rec)["republished"] == 0
    assert rclient.llen("short") == 3


def test_the_feeder_keeps_the_broker_bounded(rclient: redis.Redis) -> None:
    ledger = Ledger(rclient, "r1")
    ledger.call(t.enqueue(ledger.k, "P", [spec(i) for i in range(10)], 4))
    assert rclient.llen("short") == 4
    settings = Settings.load(env={}, max_queued=4)
    for _ in range(3):
        rclient.rpop("short")  # a worker consumes
        upkeep_once(rclient, settings, Reconciler())
        assert rclient.llen("short") == 4


def test_a_worker_killed_in_its_pass_holds_up_reaping_no_longer_than_a_lease(rclient: redis.Redis) -> None:
    # Given a worker that took the upkeep's lock and died during its pass (it never releases it),
    # and a job whose worker died too: its lease (2 s) runs out
    settings = Settings.load(env={}, lease_ttl_s=2.0, reaper_period_s=0.2)
    dead = Upkeep(rclient, settings)
    assert dead.lock.acquire(blocking=False)
    ledger = Ledger(rclient, "r1")
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    rclient.delete("short")
    assert isinstance(ledger.call(t.claim(ledger.k, job.job_id, "w", settings.lease_ttl_s)), Claim)
    started = time.monotonic()

    # When another worker's pump runs
    alive = Upkeep(rclient, settings)
    alive.start()
    try:
        # Then the job is requeued within about a lease and a period, not when a longer lock
        # would have expired (10 s before)
        requeued = lambda: ledger.job(job.job_id)["state"] == "queued"  # noqa: E731
        wait_for(requeued, 8, "the expired lease to be reaped", 0.05)
    finally:
        alive.stop()
    took = time.monotonic() - started
    assert took <= settings.lease_ttl_s + 2 * settings.reaper_period_s + 1.0, took
