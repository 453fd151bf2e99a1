"""A job's path on the worker's loop (``workers/job_path.py``), and what it hands back to the task's
thread: a worker's runtime in this process, the real redis-server and the sim, and
``workers.job.run_job`` called from a thread as Celery's pool calls it."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import redis

from tests.procs import Proc, RedisServer, start_sim, wait_for
from tests.test_ledger import spec
from tests.trips import TripCounter
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.jobspec import JobSpec
from tokenmill.ledger import Ledger
from tokenmill.ledger_async import AsyncLedger
from tokenmill.lengths import parse_counts
from tokenmill.settings import Settings
from workers.admission.limiter import Slot
from workers.attempt import attempt_job
from workers.job import run_job
from workers.runtime import Runtime

RUN = "onloop"
JOB_SCRIPTS = ("hmget", "evalsha:start", "evalsha:finish")


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[str]:
    proc, url = start_sim(tmp_path)
    yield url
    proc.stop()


def runtime(redis_url: str, sim_url: str, **settings: object) -> Runtime:
    return Runtime(Settings.load(env={}, redis_url=redis_url, server_url=sim_url, **settings))


def enqueue(rclient: redis.Redis, n: int) -> list[JobSpec]:
    jobs = [spec(i) for i in range(n)]
    ledger = Ledger(rclient, RUN)
    ledger.call(t.enqueue(ledger.k, "P", jobs, 1000))
    return jobs


def first_in_line(rt: Runtime, go_on: threading.Event) -> Future[None]:
    """A job that got to the process's admission line first and stays at its head until
    ``go_on`` is set."""

    async def stay() -> None:
        async with rt.admission.line.join():
            while not go_on.is_set():
                await asyncio.sleep(0.01)

    ahead = rt.loop.submit(stay())
    wait_for(lambda: len(rt.admission.line._turns) == 1, 5, "the first job in line")
    return ahead


def by_connection(counter: TripCounter, rclient: redis.Redis) -> tuple[Counter[str], Counter[str]]:
    """What the loop's connection sent, and what every other client sent."""
    loop_addrs = {c["addr"] for c in rclient.client_list() if c["name"].startswith("tokenmill-loop:")}
    on_loop: Counter[str] = Counter()
    elsewhere: Counter[str] = Counter()
    for conn, counts in counter.by_conn.items():
        (on_loop if conn in loop_addrs else elsewhere).update(counts)
    return on_loop, elsewhere


def test_a_job_runs_from_peek_to_commit_on_the_loops_connection(
    redis_url: str, rclient: redis.Redis, sim: str
) -> None:
    rt = runtime(redis_url, sim)
    try:
        jobs = enqueue(rclient, 3)
        with TripCounter(redis_url) as counter:
            outcomes = [run_job(rt, RUN, job.job_id) for job in jobs]
        on_loop, elsewhere = by_connection(counter, rclient)
    finally:
        rt.loop.stop()

    assert outcomes == ["done"] * 3
    assert all(on_loop[name] == 3 for name in JOB_SCRIPTS), on_loop
    assert not any(elsewhere[name] for name in (*JOB_SCRIPTS, "evalsha:wait")), elsewhere
    assert Ledger(rclient, RUN).counts()["P"]["done"] == 3


def test_a_job_behind_others_in_the_loops_line_waits_its_turn_holding_a_waiting_lease(
    redis_url: str, rclient: redis.Redis, sim: str
) -> None:
    rt = runtime(redis_url, sim)
    (job,) = enqueue(rclient, 1)
    waiting = keys.RunKeys(RUN).waiting()
    go_on = threading.Event()
    outcome: list[str] = []
    try:
        ahead = first_in_line(rt, go_on)
        with TripCounter(redis_url) as counter:
            thread = threading.Thread(target=lambda: outcome.append(run_job(rt, RUN, job.job_id)))
            thread.start()
            # Then the job stands behind it, holding a waiting lease, until it has gone
            wait_for(lambda: rclient.zscore(waiting, job.job_id) is not None, 10, "a waiting lease")
            assert not outcome and len(rt.admission.line._turns) == 2
            go_on.set()
            ahead.result(10)
            thread.join(30)
        on_loop, _ = by_connection(counter, rclient)
    finally:
        rt.loop.stop()

    assert outcome == ["done"]
    assert rclient.zcard(waiting) == 0  # the claim dropped the waiting lease
    assert on_loop["evalsha:wait"] >= 1 and on_loop["evalsha:start"] == 1


def test_a_job_waiting_for_admission_when_the_worker_stops_is_given_back_unclaimed(
    redis_url: str, rclient: redis.Redis, sim: str
) -> None:
    rt = runtime(redis_url, sim)
    (job,) = enqueue(rclient, 1)
    go_on = threading.Event()
    outcome: list[str] = []
    try:
        ahead = first_in_line(rt, go_on)
        thread = threading.Thread(target=lambda: outcome.append(run_job(rt, RUN, job.job_id)))
        thread.start()
        wait_for(lambda: len(rt.admission.line._turns) == 2, 10, "the job in line")
        rt.stopping.set()  # as the worker's shutdown hook does
        thread.join(10)
        go_on.set()
        ahead.result(10)
    finally:
        rt.loop.stop()

    assert outcome == ["stopping"]  # the task republishes it (workers/task.py)
    job_fields = rclient.hgetall(keys.RunKeys(RUN).job(job.job_id))
    assert job_fields[b"state"] == b"queued" and rclient.zcard(keys.RunKeys(RUN).waiting()) == 0


def test_a_job_delivered_while_redis_is_down_waits_on_the_loop_and_runs_once_it_is_back(
    tmp_path: Path, sim: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    rclient = server.client()
    rt = runtime(server.url, sim)
    outcome: list[str] = []
    try:
        (job,) = enqueue(rclient, 1)
        rclient.execute_command("BGREWRITEAOF")  # the job is on disk before the crash
        wait_for(lambda: rclient.info("persistence")["aof_rewrite_in_progress"] == 0, 10, "the AOF rewrite")
        server.kill()
        thread = threading.Thread(target=lambda: outcome.append(run_job(rt, RUN, job.job_id)))
        thread.start()
        wait_for(lambda: "Redis unavailable" in caplog.text, 10, "the job to find Redis down")
        assert not outcome
        server.start()
        thread.join(60)
        done = Ledger(rclient, RUN).counts()["P"]["done"]
    finally:
        rt.loop.stop()
        server.kill()

    assert outcome == ["done"] and done == 1


def test_a_commit_whose_reply_was_lost_is_sent_again_and_counts_once(
    redis_url: str, rclient: redis.Redis, sim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = runtime(redis_url, sim)
    sent = AsyncLedger.call
    lost: list[bool] = []

    async def lost_reply(self: AsyncLedger, call: t.Call[object]) -> object:
        verdict = await sent(self, call)
        if call.script in ("commit", "finish") and not lost:  # the first reply is lost, after Redis committed
            lost.append(True)
            raise redis.ConnectionError("the connection to Redis was lost")
        return verdict

    try:
        warm, job = enqueue(rclient, 2)
        assert run_job(rt, RUN, warm.job_id) == "done"
        monkeypatch.setattr(AsyncLedger, "call", lost_reply)
        outcome = run_job(rt, RUN, job.job_id)
    finally:
        rt.loop.stop()

    # The second commit found the job done: one result, one count, each length reported once
    assert outcome == "done" and lost == [True]
    assert Ledger(rclient, RUN).counts()["P"]["done"] == 2
    lengths = rclient.hgetall(keys.RunKeys(RUN).lengths())
    _, ended, _ = parse_counts(lengths)
    assert sum(ended.values()) == 2 and lengths[b"pn"] == b"2"


def test_an_error_on_the_loop_is_settled_by_the_thread(
    redis_url: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    proc: Proc
    proc, url = start_sim(tmp_path, "--sim-error-every", "1")  # every stream ends in an error chunk
    rt = runtime(redis_url, url, retry_backoff_s=0.1)
    try:
        warm, job = enqueue(rclient, 2)
        run_job(rt, RUN, warm.job_id)
        outcome = run_job(rt, RUN, job.job_id)
    finally:
        rt.loop.stop()
        proc.stop()

    assert outcome == "delayed"
    fields = rclient.hgetall(keys.RunKeys(RUN).job(job.job_id))
    assert fields[b"state"] == b"queued" and fields[b"last_error_class"] == b"stream_error"


def test_a_paced_head_asks_again_when_the_next_start_is_due_not_at_its_poll(
    redis_url: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    # Given a fresh window of 10 on a pool that binds, its requests living 2 s: admission starts
    # one every 200 ms, two at once at most; the line's poll is 5 s, and the jobs (10 tokens at
    # 300 ms) free no slot for 3 s
    proc, sim = start_sim(tmp_path, "--sim-step-ms", "300")
    rt = runtime(redis_url, sim, admission_wait_s=5.0, admission_poll_s=10.0)
    jobs = enqueue(rclient, 4)
    seconds, micros = rclient.time()
    rclient.hset(
        keys.admission_used(sim),
        mapping={
            "window": 10,
            "window_ms": seconds * 1000 + micros // 1000,
            "life_ms": 2000,
            "life_dev": 0,
            "bound": 1,
        },
    )
    outcomes: list[str] = []
    threads = [
        threading.Thread(target=lambda j=j: outcomes.append(run_job(rt, RUN, j.job_id)), daemon=True)
        for j in jobs
    ]
    try:
        # When four jobs arrive at once
        for thread in threads:
            thread.start()
        # Then two start, and the others as their starts come due, not after the line's poll
        wait_for(lambda: Ledger(rclient, RUN).counts()["P"]["queued"] == 0, 1.5, "4 jobs started, paced")
        assert int(rclient.hget(keys.admission_used(sim), "paced") or 0) >= 1  # they were paced
        for thread in threads:
            thread.join(30)
    finally:
        rt.stopping.set()  # (after a failed check, the jobs still in line give up)
        for thread in threads:
            thread.join(10)
        rt.loop.stop()
        proc.stop()
    assert outcomes == ["done"] * 4


def test_a_refused_continuation_that_starts_over_still_reports_its_first_token(
    tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    """Affinity learns that a job's prefix is cached on its server from the stream's first chunk;
    a job whose checkpoint the server refuses to continue starts over, and that stream's first
    chunk is the one to report."""
    proc, url = start_sim(tmp_path, "--sim-refuse-continuations")
    rt = runtime(redis_url, url)
    firsts: list[str] = []
    try:
        (job,) = enqueue(rclient, 1)
        ledger = Ledger(rclient, RUN)
        claim = ledger.call(t.claim(ledger.k, job.job_id, "tester", 60))
        assert isinstance(claim, t.Claim)
        claim.checkpoint = t.Checkpoint(content="Once upon", tokens=2, prompt_tokens=5)
        attempt = attempt_job(rt, claim, url, Slot(url, "m", 0), on_first=lambda: firsts.append("first"))
        done = rt.loop.submit(attempt).result(30)
    finally:
        rt.loop.stop()
        proc.stop()

    assert done.error is None and not done.state.base, done.error  # it started over, and ended
    assert firsts == ["first"]
