"""What a job costs a real worker beyond its stream: Redis round trips, task events, logs.

Real redis-server, real ``tokenmill worker`` processes, the sim; round trips are counted with
``MONITOR`` (:class:`tests.trips.TripCounter`), task events read off Redis pub/sub.
"""

from __future__ import annotations

import base64
import threading
from collections import Counter
from pathlib import Path

import orjson
import redis

from tests.pipeline import cli, write_jsonl
from tests.procs import Proc, start_sim, start_worker, wait_for, worker_env
from tests.trips import TripCounter
from tokenmill.ledger import Ledger

# Round trips a worker makes on a timer (upkeep, load watch, length curve), not per job.
PERIODIC = {
    "get", "set", "pexpire", "ping", "hello", "client", "select", "info", "time", "llen", "lrange",
    "hgetall", "smembers", "zrange", "zrangebyscore", "zrem", "del", "echo", "script",
    "evalsha:adapt", "evalsha:reap", "evalsha:promote", "evalsha:feed",
}  # fmt: skip
# A job, when nothing goes wrong: BRPOP, kombu's unacked bookkeeping (MULTI/EXEC on delivery and
# on the ack), the peek, start.lua, finish.lua; a job that waits in line takes a waiting lease
# (one more). Before issue 14 it was 12.5 on bench/jobcost.py's workload (task events, the
# admission load, separate admit and claim, commit and unadmit, the waiting lease's drop).
MAX_TRIPS_PER_JOB = 7.5


class EventTap(threading.Thread):
    """Celery's events on Redis pub/sub (kombu's fanout), counted by type. Task events come
    batched (a ``task-multi`` message holds a list)."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.pubsub = client.pubsub()
        self.pubsub.psubscribe("*celeryev*")
        self.types: Counter[str] = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            msg = self.pubsub.get_message(timeout=0.2)
            if msg and msg["type"] == "pmessage":
                envelope = orjson.loads(msg["data"])
                body = envelope["body"]
                if envelope["properties"].get("body_encoding") == "base64":
                    body = base64.b64decode(body)
                events = orjson.loads(body)
                for event in events if isinstance(events, list) else [events]:
                    self.types[event["type"]] += 1

    def task_events(self) -> int:
        return sum(n for kind, n in self.types.items() if kind.startswith("task-"))

    def close(self) -> None:
        self.stop.set()
        self.join(5)
        self.pubsub.close()


def run_jobs(tmp_path: Path, env: dict[str, str], run: str, n: int, rclient: redis.Redis) -> None:
    rows = [{"id": f"j{i}", "prompt": f"question {i}"} for i in range(n)]
    data = write_jsonl(tmp_path / f"{run}.jsonl", rows)
    cli("enqueue", str(data), "--run", run, "--short-max-tokens", "8", env=env)
    wait_for(lambda: Ledger(rclient, run).counts()[run]["done"] == n, 60, f"the {n} jobs of {run}")


def test_task_events_are_off_by_default_and_on_with_the_setting(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    sim, sim_url = start_sim(tmp_path)
    procs.append(sim)
    tap = EventTap(rclient)
    tap.start()
    try:
        # Given a worker with default settings
        worker = start_worker(tmp_path, "short", worker_env(redis_url, sim_url), concurrency=4)
        procs.append(worker)
        # When it runs five jobs
        run_jobs(tmp_path, worker_env(redis_url, sim_url), "evoff", 5, rclient)
        # Then it sent worker events (its heartbeat) but no task event, and logged no task line
        assert "tokenmill.generate[" not in worker.output() and "HTTP Request" not in worker.output()
        worker.stop()  # its event buffer is flushed before its worker-offline event
        wait_for(lambda: tap.types["worker-offline"], 10, "the worker's worker-offline event")
        assert tap.types["worker-online"] == 1 and tap.task_events() == 0, tap.types

        # Given a worker with TOKENMILL_TASK_EVENTS=1
        env = worker_env(redis_url, sim_url, task_events=1)
        procs.append(start_worker(tmp_path, "short", env, concurrency=4))
        # When it runs five jobs, then each sends received, started and succeeded
        run_jobs(tmp_path, env, "evon", 5, rclient)
        wait_for(lambda: tap.types["task-succeeded"] >= 5, 10, "5 task-succeeded events", 0.1)
        assert tap.types["task-received"] == tap.types["task-started"] == 5, tap.types
    finally:
        tap.close()


def test_streams_run_on_uvloop_by_default_and_on_asyncio_with_the_setting(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    sim, sim_url = start_sim(tmp_path)
    procs.append(sim)
    for kind, loop in (("uvloop", "uvloop.Loop"), ("asyncio", "asyncio.unix_events._UnixSelectorEventLoop")):
        # Given a worker with TOKENMILL_EVENT_LOOP unset (uvloop), then set to asyncio
        env = worker_env(redis_url, sim_url, **({"event_loop": kind} if kind == "asyncio" else {}))
        worker = start_worker(tmp_path, "short", env, concurrency=4)
        procs.append(worker)
        # Then it says which loop its streams run on, and runs jobs on it
        assert f"streams run on one event loop: {loop}" in worker.output()
        run_jobs(tmp_path, env, f"loop{kind}", 5, rclient)
        worker.stop()
    # A loop tokenmill does not know is refused, named
    res = cli("worker", "--queue", "short", env={**env, "TOKENMILL_EVENT_LOOP": "trio"}, check=False)
    assert res.returncode != 0 and "TOKENMILL_EVENT_LOOP='trio' must be one of uvloop, asyncio" in res.stderr


def test_a_job_takes_a_bounded_number_of_redis_round_trips(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    n = 60
    sim, sim_url = start_sim(tmp_path)
    procs.append(sim)
    env = worker_env(redis_url, sim_url)
    rows = [{"id": f"j{i}", "prompt": f"question {i}"} for i in range(n)]
    data = write_jsonl(tmp_path / "trips.jsonl", rows)
    # the enqueue's own round trips, counted alone first (no worker runs yet), then forgotten
    with TripCounter(redis_url) as calib:
        cli("enqueue", str(data), "--run", "trips", "--short-max-tokens", "8", env=env)
    enqueue_trips = calib.counts
    rclient.flushall()
    procs.append(start_worker(tmp_path, "short", env, concurrency=8))

    polls = 0

    def done() -> bool:
        nonlocal polls
        polls += 1
        return int(rclient.hget("tm:trips:counts", "done|trips") or 0) == n

    with TripCounter(redis_url) as counter:
        cli("enqueue", str(data), "--run", "trips", "--short-max-tokens", "8", env=env)
        wait_for(done, 60, f"the {n} jobs")
    trips = counter.counts
    trips.subtract(enqueue_trips)
    trips["hget"] -= polls
    per_job = {name: c / n for name, c in (+trips).items() if name not in PERIODIC}
    total = sum(per_job.values())
    assert total <= MAX_TRIPS_PER_JOB, sorted(per_job.items(), key=lambda kv: -kv[1])
    # no task events (they would be a PUBLISH per job; a broadcast of the worker's own, once a
    # run, was seen under load)
    assert per_job.get("publish", 0) < 0.5
    assert per_job["evalsha:start"] >= 1 and per_job["evalsha:finish"] == 1
    assert "evalsha:claim" not in per_job and "evalsha:unadmit" not in per_job
