"""Cancel and retry as ledger transitions, and what the other transitions do with a cancelled or
marked job, on a real redis-server."""

from __future__ import annotations

import orjson
import pytest
import redis

from producer.cancel import cancel_run
from producer.retry import retry_run
from tests.procs import wait_for
from tests.test_ledger import claimed, spec
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.errors import ConfigError
from tokenmill.ledger import Ledger
from tokenmill.transitions import ALIVE, CANCEL_NOW, Beat, Checkpoint, JobError

RUN = "ops"
K = keys.RunKeys(RUN)


@pytest.fixture
def ledger(rclient: redis.Redis) -> Ledger:
    return Ledger(rclient, RUN)


def test_cancel_ends_queued_jobs_and_marks_running_ones(ledger: Ledger, rclient: redis.Redis) -> None:
    # Given three queued jobs in P, one of them running and one waiting out a retry backoff
    jobs = [spec(i) for i in range(3)]
    ledger.call(t.enqueue(ledger.k, "P", jobs, 100))
    running = claimed(ledger, jobs[0])
    backoff = claimed(ledger, jobs[1])
    ledger.call(t.release(ledger.k, backoff, JobError("stall", "s"), delay_s=60, burn=True, max_attempts=5))
    assert rclient.zcard(K.delayed()) == 1

    # When the run is cancelled without --now
    summary = cancel_run(rclient, RUN)

    # Then the queued jobs are cancelled (also out of the delayed set), the running one marked
    assert (summary.cancelled, summary.running) == (2, 1)
    assert ledger.counts()["P"] == {"queued": 0, "running": 1, "done": 0, "failed": 0, "cancelled": 2}
    assert rclient.zcard(K.delayed()) == 0
    assert ledger.job(jobs[0].job_id)["cancel"] == "after"
    # and the running job still commits: running jobs finish
    assert (
        ledger.call(t.commit(ledger.k, running, {"content": "x", "usage": {"completion_tokens": 1}}, 1))
        == "ok"
    )
    assert ledger.counts()["P"]["done"] == 1
    # and a later delivery of a cancelled job does nothing
    assert ledger.call(t.claim(ledger.k, jobs[2].job_id, "w", 30)) == "cancelled"
    assert ledger.counts()["P"] == {"queued": 0, "running": 0, "done": 1, "failed": 0, "cancelled": 2}


def test_a_marked_job_released_or_reaped_ends_cancelled_with_its_checkpoint(
    ledger: Ledger, rclient: redis.Redis
) -> None:
    a, b = spec(1), spec(2)
    ledger.call(t.enqueue(ledger.k, "P", [a, b], 100))
    rclient.delete("short")
    ca = claimed(ledger, a)
    claimed(ledger, b, ttl=0.001)
    cancel_run(rclient, RUN)

    # A released job (a retryable error, a shutdown, cancel --now) ends cancelled, not queued
    out = ledger.call(
        t.release(
            ledger.k,
            ca,
            JobError("stall", "s"),
            delay_s=0,
            burn=True,
            max_attempts=5,
            checkpoint=Checkpoint("ab", "", 2),
        )
    )
    assert out == "cancelled"
    assert ledger.job(a.job_id)["ckpt_content"] == "ab"
    # a job whose worker died is not taken over, and the reaper ends it cancelled
    lease = int(ledger.job(b.job_id)["lease"])
    wait_for(
        lambda: int(rclient.time()[0]) * 1000 + rclient.time()[1] // 1000 > lease, 5, "b's lease to lapse"
    )
    assert ledger.call(t.claim(ledger.k, b.job_id, "w2", 30)) == "cancelled"
    wait_for(
        lambda: ledger.reap_expired() == [] and ledger.job(b.job_id)["state"] == "cancelled",
        5,
        "the reaper to end the marked job cancelled",
    )
    assert rclient.llen("short") == 0, "nothing may be published for a cancelled job"
    assert ledger.counts()["P"] == {"queued": 0, "running": 0, "done": 0, "failed": 0, "cancelled": 2}


def test_cancel_now_is_the_heartbeats_reply(ledger: Ledger, rclient: redis.Redis) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    beat = t.heartbeat(Beat(claimed(ledger, job), Checkpoint("abc", "", 3), 3), 30)
    assert ledger.call(beat) == ALIVE
    cancel_run(rclient, RUN, now=True)
    assert ledger.call(beat) == CANCEL_NOW
    assert ledger.job(job.job_id)["ckpt_content"] == "abc", "the last checkpoint is still written"
    # a later cancel without --now does not lower the mark
    cancel_run(rclient, RUN)
    assert ledger.job(job.job_id)["cancel"] == "now"


def test_cancel_of_one_partition_leaves_the_others(ledger: Ledger, rclient: redis.Redis) -> None:
    ledger.call(t.enqueue(ledger.k, "P", [spec(1, "P")], 100))
    ledger.call(t.enqueue(ledger.k, "Q", [spec(2, "Q")], 100))
    assert cancel_run(rclient, RUN, partition="Q").cancelled == 1
    counts = ledger.counts()
    # every partition carries `cancelled` once anything was cancelled
    assert counts["P"] == {"queued": 1, "running": 0, "done": 0, "failed": 0, "cancelled": 0}
    assert counts["Q"] == {"queued": 0, "running": 0, "done": 0, "failed": 0, "cancelled": 1}


def test_the_feeder_drops_backlogged_ids_of_cancelled_jobs(ledger: Ledger, rclient: redis.Redis) -> None:
    ledger.call(t.enqueue(ledger.k, "P", [spec(i) for i in range(5)], 2))  # 2 published, 3 on the backlog
    job = spec(3)
    for chunk in ledger.pick(["P"], ("queued",)):
        ledger.call(t.cancel(ledger.k, [j.job_id for j in chunk], now=False))
    ledger.call(t.enqueue(ledger.k, "P", [spec(9)], 2))  # one more queued job, on the backlog too
    rclient.delete("short")
    assert ledger.feed_backlog("short", 10) == 1
    assert rclient.llen(K.backlog("short")) == 0
    body = orjson.loads(rclient.rpop("short"))["headers"]["argsrepr"]
    assert spec(9).job_id in body and job.job_id not in body


def _fail(ledger: Ledger, job, cls: str) -> None:  # type: ignore[no-untyped-def]
    c = claimed(ledger, job)
    ledger.call(t.release(ledger.k, c, JobError("stall", "first"), delay_s=0, burn=True, max_attempts=9))
    c = claimed(ledger, job)
    assert ledger.call(t.fail(ledger.k, c, JobError(cls, f"{cls} happened"))) == "ok"


def test_retry_by_class_resets_the_budget_and_moves_counts(ledger: Ledger, rclient: redis.Redis) -> None:
    # Given four failed jobs: three context_length, one auth
    jobs = [spec(i) for i in range(4)]
    ledger.call(t.enqueue(ledger.k, "P", jobs, 100))
    for job, cls in zip(jobs, ["context_length"] * 3 + ["auth"], strict=True):
        _fail(ledger, job, cls)
    rclient.delete("short")

    # When the context_length failures are retried with room for two messages
    summary = retry_run(rclient, RUN, max_queued=2, classes=("context_length",))

    # Then those three are queued with a fresh budget, two published and one on the backlog
    assert summary.by_class == {"context_length": 3} and summary.backlogged == 1
    assert "3 failed jobs back to queued (context_length 3); 1 wait on the backlog" in summary.line()
    assert rclient.llen("short") == 2 and rclient.llen(K.backlog("short")) == 1
    assert ledger.counts()["P"] == {"queued": 3, "running": 0, "done": 0, "failed": 1}
    job = ledger.job(jobs[0].job_id)
    assert job["state"] == "queued" and job["retries"] == "0" and "error_class" not in job
    assert job["last_error_class"] == "context_length"
    # the failures hash holds what is failed now; every failure ever is failures + retried
    assert rclient.hgetall(K.failures()) == {b"auth": b"1"}
    assert rclient.hgetall(K.retried()) == {b"context_length": b"3"}
    # the auth failure was left alone, and a second retry finds nothing of that class
    assert ledger.job(jobs[3].job_id)["state"] == "failed"
    assert retry_run(rclient, RUN, 2, classes=("context_length",)).total == 0
    # a retried job runs again with a new attempt number (request ids stay unique)
    assert claimed(ledger, jobs[0]).attempt == 3


def test_retry_cancelled_brings_them_back_with_their_checkpoints(
    ledger: Ledger, rclient: redis.Redis
) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job, spec(2)], 100))
    c = claimed(ledger, job)
    cancel_run(rclient, RUN, now=True)
    ledger.call(
        t.release(
            ledger.k,
            c,
            JobError("cancelled", "x"),
            delay_s=0,
            burn=False,
            max_attempts=5,
            checkpoint=Checkpoint("ab", "", 2),
        )
    )
    rclient.delete("short")
    assert retry_run(rclient, RUN, 100).total == 0, "retry without --cancelled takes failed jobs only"

    summary = retry_run(rclient, RUN, 100, cancelled=True)

    assert summary.total == 2 and rclient.llen("short") == 2
    assert ledger.counts()["P"] == {"queued": 2, "running": 0, "done": 0, "failed": 0, "cancelled": 0}
    again = claimed(ledger, job)
    assert again.checkpoint == Checkpoint("ab", "", 2), "it continues where it was stopped"
    assert "cancel" not in ledger.job(job.job_id)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: cancel_run(c, "nope"), "--run 'nope': no run of that name in this Redis (its runs: ops)"),
        (lambda c: retry_run(c, "nope", 10), "--run 'nope': no run of that name"),
        (
            lambda c: cancel_run(c, RUN, partition="Z"),
            "--partition 'Z': run 'ops' has no partition of that name",
        ),
        (lambda c: retry_run(c, RUN, 10, partition="Z"), "(its partitions: P)"),
        (lambda c: retry_run(c, RUN, 10, classes=("ctx_len",)), "--class 'ctx_len' is not a failure class"),
        (lambda c: retry_run(c, RUN, 10, classes=("auth",), cancelled=True), "give one"),
    ],
)
def test_bad_input_is_an_error_naming_it(ledger: Ledger, rclient: redis.Redis, call, message) -> None:  # type: ignore[no-untyped-def]
    ledger.call(t.enqueue(ledger.k, "P", [spec(1)], 100))
    with pytest.raises(ConfigError) as err:
        call(rclient)
    assert message in str(err.value)


def test_a_known_class_with_no_failed_jobs_retries_nothing(ledger: Ledger, rclient: redis.Redis) -> None:
    ledger.call(t.enqueue(ledger.k, "P", [spec(1)], 100))
    assert retry_run(rclient, RUN, 10, classes=("stall",)).line() == (
        "run ops: no failed jobs to retry — nothing to do"
    )
