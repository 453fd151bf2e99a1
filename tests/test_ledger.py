"""Each ledger transition's pre- and post-conditions, on a real redis-server."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest
import redis

from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.jobspec import JobSpec, canonical, content_hash, job_id_for
from tokenmill.ledger import Ledger
from tokenmill.transitions import Checkpoint, Claim, JobError

RUN = "r1"


def build_spec(
    *,
    partition: str,
    queue: str,
    source: str,
    request: dict[str, Any],
    metadata: dict[str, Any],
    record_id: str | None,
) -> JobSpec:
    """A job spec the plain way: the request dumped by :func:`tokenmill.jobspec.canonical` (the
    producer's own path assembles the same bytes from parts: tests/test_jobspec.py)."""
    request_json = canonical(request)
    digest = content_hash(request_json)
    return JobSpec(
        job_id=job_id_for(partition, record_id, digest),
        partition=partition,
        queue=queue,
        source=source,
        digest=digest,
        request=request,
        metadata=metadata,
        record_id=record_id,
        request_json=request_json,
        metadata_json=orjson.dumps(metadata),
    )


def spec(
    n: int, partition: str = "P", queue: str = "short", record_id: str | None = None, text: str | None = None
) -> JobSpec:
    return build_spec(
        partition=partition,
        queue=queue,
        source=f"f.jsonl:{n}",
        request={"model": "m", "messages": [{"role": "user", "content": text or f"q{n}"}], "max_tokens": 10},
        metadata={},
        record_id=record_id,
    )


@pytest.fixture
def ledger(rclient: redis.Redis) -> Ledger:
    return Ledger(rclient, RUN)


def counts(ledger: Ledger, partition: str = "P") -> dict[str, int]:
    return ledger.counts()[partition]


def claimed(ledger: Ledger, job: JobSpec, worker: str = "w1", ttl: float = 30) -> Claim:
    c = ledger.call(t.claim(ledger.k, job.job_id, worker, ttl))
    assert isinstance(c, Claim), c
    return c


def _claim_or_none(ledger: Ledger, job: JobSpec, worker: str) -> Claim | None:
    c = ledger.call(t.claim(ledger.k, job.job_id, worker, 30))
    return c if isinstance(c, Claim) else None


def test_enqueue_creates_once_and_publishes_once(ledger: Ledger, rclient: redis.Redis) -> None:
    jobs = [spec(1), spec(2, queue="long")]
    assert ledger.call(t.enqueue(ledger.k, "P", jobs, 100)) == ["new", "new"]
    assert ledger.call(t.enqueue(ledger.k, "P", jobs, 100)) == ["queued", "queued"]
    assert counts(ledger) == {"queued": 2, "running": 0, "done": 0, "failed": 0}
    assert rclient.llen("short") == 1 and rclient.llen("long") == 1
    assert [x.decode() for x in rclient.lrange(keys.RunKeys(RUN).jobs("P"), 0, -1)] == [
        j.job_id for j in jobs
    ]


def test_same_id_with_other_content_is_a_conflict_naming_the_first_source(ledger: Ledger) -> None:
    first = spec(1, record_id="7", text="a")
    other = build_spec(
        partition="P",
        queue="short",
        source="g.jsonl:9",
        request={"model": "m", "messages": [{"role": "user", "content": "b"}], "max_tokens": 10},
        metadata={},
        record_id="7",
    )
    ledger.call(t.enqueue(ledger.k, "P", [first], 100))
    assert ledger.call(t.enqueue(ledger.k, "P", [other], 100)) == ["conflict:f.jsonl:1"]
    assert orjson.loads(ledger.job("P:7")["spec"])["request"]["messages"][0]["content"] == "a"


def test_enqueue_beyond_max_depth_parks_ids_on_the_backlog_and_feed_publishes_them(
    ledger: Ledger, rclient: redis.Redis
) -> None:
    out = ledger.call(t.enqueue(ledger.k, "P", [spec(i) for i in range(5)], 2))
    assert out == ["new", "new", "backlog", "backlog", "backlog"]
    assert rclient.llen("short") == 2
    rclient.delete("short")
    assert ledger.feed_backlog("short", 2) == 2
    assert rclient.llen("short") == 2 and rclient.llen(keys.RunKeys(RUN).backlog("short")) == 1


def test_messages_and_backlogged_ids_leave_in_enqueue_order(ledger: Ledger, rclient: redis.Redis) -> None:
    jobs = [spec(i, queue="long" if i % 3 == 0 else "short") for i in range(12)]
    ledger.call(t.enqueue(ledger.k, "P", jobs[:5], 3))
    ledger.call(t.enqueue(ledger.k, "P", jobs[5:], 3))

    def next_job(queue: str) -> str:
        body = orjson.loads(rclient.rpop(queue))["body"]  # workers take from the right (BRPOP)
        return orjson.loads(base64.b64decode(body))[0][2]

    short = [j.job_id for j in jobs if j.queue == "short"]
    long = [j.job_id for j in jobs if j.queue == "long"]
    assert [next_job("short") for _ in range(3)] == short[:3]
    assert [next_job("long") for _ in range(3)] == long[:3]
    backlog = keys.RunKeys(RUN).backlog
    assert [x.decode() for x in rclient.lrange(backlog("short"), 0, -1)] == short[3:]
    assert [x.decode() for x in rclient.lrange(backlog("long"), 0, -1)] == long[3:]


def test_an_abandoned_enqueue_stream_leaves_no_reply_for_the_next_command(ledger: Ledger) -> None:
    with pytest.raises(RuntimeError), ledger.enqueue_stream() as stream:
        stream.send("P", [spec(1), spec(2)], 100)
        stream.send("P", [spec(3)], 100)
        raise RuntimeError("the producer stopped with two batches unread")

    assert ledger.call(t.enqueue(ledger.k, "P", [spec(4)], 100)) == ["new"]
    assert counts(ledger)["queued"] == 4


def test_an_enqueue_stream_survives_a_script_cache_flush_with_batches_in_flight(
    ledger: Ledger, rclient: redis.Redis
) -> None:
    ledger.call(
        t.enqueue(ledger.k, "P", [spec(0)], 100)
    )  # the script is loaded once, then forgotten by Redis
    rclient.script_flush()

    with ledger.enqueue_stream() as stream:
        stream.send("P", [spec(1), spec(2)], 100)
        stream.send("P", [spec(3), spec(1)], 100)
        outcomes = [stream.read()[1], stream.read()[1]]

    assert outcomes == [["new", "new"], ["new", "queued"]]
    listed = rclient.lrange(keys.RunKeys(RUN).jobs("P"), 0, -1)
    assert [x.decode() for x in listed] == [spec(i).job_id for i in range(4)]


def test_claim_moves_queued_to_running_with_a_fencing_token(ledger: Ledger) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    c = claimed(ledger, job)
    assert c.token == "1" and c.attempt == 1 and c.spec["request"]["max_tokens"] == 10
    assert counts(ledger)["running"] == 1 and counts(ledger)["queued"] == 0
    assert ledger.call(t.claim(ledger.k, job.job_id, "w2", 30)) == "busy"
    assert ledger.call(t.claim(ledger.k, "nope", "w2", 30)) == "missing"


def test_a_stale_fencing_token_is_refused_everywhere(ledger: Ledger) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    old = claimed(ledger, job, ttl=0.001)
    from tests.procs import wait_for

    new = wait_for(lambda: _claim_or_none(ledger, job, "w2"), 5, "a takeover after the lease expired")
    assert new.token == "2"
    assert ledger.call(t.heartbeat(t.Beat(old, None, 0), 30)) == 0
    assert ledger.call(t.commit(ledger.k, old, {"content": "x"}, 0)) == "stale"
    assert ledger.call(t.fail(ledger.k, old, JobError("x", "y"))) == "stale"
    assert (
        ledger.call(t.release(ledger.k, old, JobError("x", "y"), delay_s=0, burn=True, max_attempts=3))
        == "stale"
    )
    assert counts(ledger) == {"queued": 0, "running": 1, "done": 0, "failed": 0}
    assert (
        ledger.call(t.commit(ledger.k, new, {"content": "ok", "usage": {"completion_tokens": 3}}, 3)) == "ok"
    )


def test_commit_is_final_and_idempotent(ledger: Ledger, rclient: redis.Redis) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    c = claimed(ledger, job)
    ledger.call(t.heartbeat(t.Beat(c, Checkpoint("par", "", 2), 2), 30))
    assert (
        ledger.call(t.commit(ledger.k, c, {"content": "partial+rest", "usage": {"completion_tokens": 5}}, 3))
        == "ok"
    )
    assert ledger.call(t.commit(ledger.k, c, {"content": "again"}, 0)) == "done"
    assert ledger.call(t.claim(ledger.k, job.job_id, "w2", 30)) == "done"
    data = ledger.job(job.job_id)
    assert data["state"] == "done" and "ckpt_content" not in data
    assert orjson.loads(data["result"])["content"] == "partial+rest"
    assert counts(ledger) == {"queued": 0, "running": 0, "done": 1, "failed": 0}
    assert ledger.call(t.enqueue(ledger.k, "P", [job], 100)) == ["done"]
    assert rclient.zcard(keys.RunKeys(RUN).leases()) == 0


def test_fail_records_class_and_message(ledger: Ledger, rclient: redis.Redis) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    c = claimed(ledger, job)
    assert ledger.call(t.fail(ledger.k, c, JobError("context_length", "too long"))) == "ok"
    assert ledger.job(job.job_id)["error_class"] == "context_length"
    assert rclient.hget(keys.RunKeys(RUN).failures(), "context_length") == b"1"
    assert counts(ledger)["failed"] == 1
    assert ledger.call(t.claim(ledger.k, job.job_id, "w", 30)) == "failed"


def test_release_keeps_the_checkpoint_and_republishes(ledger: Ledger, rclient: redis.Redis) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    rclient.delete("short")
    c = claimed(ledger, job)
    out = ledger.call(
        t.release(
            ledger.k,
            c,
            JobError("stall", "no chunk"),
            delay_s=0,
            burn=True,
            max_attempts=3,
            checkpoint=Checkpoint("abc", "think", 4),
        )
    )
    assert out == "queued" and rclient.llen("short") == 1
    again = claimed(ledger, job)
    assert again.checkpoint == Checkpoint("abc", "think", 4) and again.retries == 1


def test_release_with_delay_waits_in_the_delayed_set(ledger: Ledger, rclient: redis.Redis) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    rclient.delete("short")
    c = claimed(ledger, job)
    assert (
        ledger.call(t.release(ledger.k, c, JobError("x", "y"), delay_s=0.05, burn=False, max_attempts=3))
        == "delayed"
    )
    assert rclient.llen("short") == 0
    from tests.procs import wait_for

    wait_for(lambda: ledger.promote_due() == 1, 5, "the delayed retry to be published")
    assert rclient.llen("short") == 1


def test_retries_are_bounded(ledger: Ledger) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    outs = []
    for _ in range(3):
        c = claimed(ledger, job)
        outs.append(
            ledger.call(
                t.release(
                    ledger.k, c, JobError("server_unavailable", "503"), delay_s=0, burn=True, max_attempts=3
                )
            )
        )
    assert outs == ["queued", "queued", "failed"]
    assert "gave up after 3 attempts" in ledger.job(job.job_id)["error"]


def test_release_without_burning_does_not_count_a_retry(ledger: Ledger) -> None:
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    for _ in range(5):
        c = claimed(ledger, job)
        assert (
            ledger.call(
                t.release(
                    ledger.k, c, JobError("server_not_ready", "down"), delay_s=0, burn=False, max_attempts=2
                )
            )
            == "queued"
        )
    assert claimed(ledger, job).retries == 0


def test_reap_requeues_only_expired_leases(ledger: Ledger, rclient: redis.Redis) -> None:
    a, b = spec(1), spec(2)
    ledger.call(t.enqueue(ledger.k, "P", [a, b], 100))
    rclient.delete("short")
    claimed(ledger, a, ttl=0.001)
    claimed(ledger, b, ttl=60)
    from tests.procs import wait_for

    assert wait_for(lambda: ledger.reap_expired(), 5, "the expired lease to be reaped") == [a.job_id]
    assert ledger.job(a.job_id)["state"] == "queued" and ledger.job(b.job_id)["state"] == "running"
    assert rclient.llen("short") == 1
    assert counts(ledger) == {"queued": 1, "running": 1, "done": 0, "failed": 0}
