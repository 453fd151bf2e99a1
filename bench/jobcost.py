"""What one job costs a worker outside streaming: CPU per job and Redis commands per job.

Jobs are cut to ``max_tokens`` 2, so the per-job work (Celery delivery, task events, the
ledger's and admission's round trips, building the request, the commit) dominates the stream.
One real ``short`` worker (``--concurrency 150``, default settings) on a private redis-server
and the sim:

- worker CPU per job: the worker process's CPU (/proc) from the moment it is ready and idle to
  the last commit, over the jobs;
- the stream path per 2-token request: the same requests through ``workers.stream.stream_chat``
  on the worker's own stream client, in this process (what bench/e2e.py --per-request measures);
- outside streaming = the difference;
- the worker's CPU per job by thread (schedstat): Celery's consumer (the main thread: BRPOP,
  kombu's unacked bookkeeping, the ack), the event loop (the busiest other thread: each job's
  ledger transitions, its wait for admission and its stream) and the other threads: the task
  threads (Celery's tracer, the hand-off to the loop, settling errors), with the upkeep's, the
  load watch's and the helper thread's that refreshes admission's figures;
- Redis round trips per job: a separate run under ``MONITOR`` (:mod:`tests.trips`), less
  the enqueue's own (counted by enqueuing the same jobs with no worker running, before) and this
  process's polls. ``evalsha:<name>`` are tokenmill's scripts; Celery's are BRPOP, kombu's
  unacked bookkeeping (``multi/exec``, on delivery and on the ack), PUBLISH of task events.

    .venv/bin/python bench/jobcost.py                  # 1,500 jobs, 3 rounds: ~2 min
    .venv/bin/python bench/jobcost.py --jobs 600 --rounds 1
    .venv/bin/python bench/jobcost.py --against TOKENMILL_EVENT_LOOP=asyncio   # A B, round by round
    .venv/bin/python bench/jobcost.py --floor          # and Celery's floor: a task that does nothing
    # the seed's output lengths (the sim's mean 4,000 tokens): the quality signals on / off by round
    TOKENMILL_QUALITY_SIGNALS=0 .venv/bin/python bench/jobcost.py --output-tokens 4000 \
        --max-tokens 10240 --against TOKENMILL_QUALITY_SIGNALS=1    # ~90 min
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis
from _common import (
    Children,
    MachineLoad,
    exit_on_sigterm,
    machine,
    median,
    proc_cpu_s,
    setting,
    settings_text,
    start_sim,
    start_worker,
    table,
    thread_cpu_s,
    thread_split,
    wait_for,
    wait_quiet,
    workdir,
)
from e2e import PARTITION, Knobs, direct_requests, routing, stream_path, write_dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ is not an installed package
from tests.trips import TripCounter
from tokenmill import keys

RUN = "jobcost"


def enqueue(client: redis.Redis, data: Path, k: Knobs) -> None:
    from producer.enqueue import Enqueuer
    from tokenmill.ledger import Ledger

    enq = Enqueuer(Ledger(client, RUN), routing(k), max_queued=100_000)
    enq.enqueue_file(data, PARTITION)
    assert enq.summary.total_new == k.prompts, enq.summary.line(RUN)


def py_spy() -> str:
    """py-spy beside this Python (a venv's bin) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    return found


def one_round(
    work: Path,
    k: Knobs,
    data: Path,
    client: redis.Redis,
    redis_url: str,
    name: str,
    count: bool,
    profile: Path | None = None,
    worker_env: dict[str, str] | None = None,
    floor: bool = False,
) -> dict[str, Any]:
    """One run of every job through a fresh worker (with ``worker_env`` on top of the defaults);
    with ``count``, its round trips (MONITOR); with ``floor``, through Celery's floor (a worker
    whose task does nothing: bench/noop_worker.py) instead."""
    where = work / name
    client.flushall()
    enq_trips: Counter[str] = Counter()
    if count:  # calibration: the enqueue's own round trips, with no worker running
        with TripCounter(redis_url) as enq_counter:
            enqueue(client, data, k)
        enq_trips = enq_counter.counts
        client.flushall()
    with Children() as ch:
        _sim, url = start_sim(ch, where, k.sim)
        env = {
            "TOKENMILL_REDIS_URL": redis_url,
            "TOKENMILL_SERVER_URL": url,
            "TOKENMILL_RESULTS_URL": str(where / "results"),  # workers do not seal; kept local anyway
            **(worker_env or {}),
        }
        worker = start_worker(ch, where, "short", k.short_concurrency, env, k.prompts if floor else None)
        time.sleep(1.0)  # let the worker's start-up work (upkeep, loadwatch) settle
        polls = 0
        done_field = keys.count_field("done", PARTITION)
        counts_key = keys.RunKeys(RUN).counts()

        def finished() -> bool:
            nonlocal polls
            polls += 1
            if not worker.alive():
                raise RuntimeError(f"the worker died:\n{worker.output()[-2000:]}")
            if floor:  # every message run, and acked
                return "messages run" in worker.output() and not client.hlen(keys.broker_unacked())
            return int(client.hget(counts_key, done_field) or 0) >= k.prompts

        spy = None
        if profile is not None:  # py-spy samples the worker's threads (collapsed stacks)
            args = [py_spy(), "record", "--pid", str(worker.pid), "--format", "raw", "--rate", "200",
                    "--threads", "--gil", "-o", str(profile)]  # fmt: skip
            spy = ch.spawn("py-spy", args, where / "py-spy.log")
            time.sleep(1.0)
        with TripCounter(redis_url) if count else contextlib.nullcontext() as counter:
            cpu0 = proc_cpu_s(worker.pid)
            threads0 = thread_cpu_s(worker.pid)
            start = time.perf_counter()
            enqueue(client, data, k)
            wait_for(finished, 3600, "the jobs to finish", 0.05)
            wall = time.perf_counter() - start
            cpu = proc_cpu_s(worker.pid) - cpu0
            split = thread_split([worker], [threads0])
        if spy is not None:
            spy.proc.send_signal(signal.SIGINT)
            spy.proc.wait(30)
    trips: Counter[str] = Counter()
    if counter is not None:
        trips = counter.counts
        trips.subtract(enq_trips)
        trips["hget"] -= polls
        trips = +trips
    return {"cpu_s": cpu, "wall_s": wall, "trips": trips, "split": split}


def by_thread(r: dict[str, Any], jobs: int) -> str:
    """The round's worker CPU per job by thread (the loop's is the busiest non-main thread)."""
    parts = ("celery consumer", "event loop", "task threads")
    return ", ".join(f"{p} {r['split'][p] / jobs * 1e3:.2f} ms" for p in parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=150)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--max-tokens", type=int, default=2, help="the jobs' max_tokens (default 2: all per-job cost)"
    )
    ap.add_argument(
        "--output-tokens", type=int, default=200, help="the sim's mean output tokens (its default 200)"
    )
    ap.add_argument(
        "--profile", type=Path, default=None, help="also profile one run's worker with py-spy into this file"
    )
    ap.add_argument(
        "--against",
        action="append",
        default=[],
        type=setting,
        metavar="NAME=VALUE",
        help="also run a worker with these settings (repeatable) right after each default round, "
        "and print the per-round ratio: e.g. --against TOKENMILL_EVENT_LOOP=asyncio",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also run Celery's floor after each round: a worker with tokenmill's Celery settings "
        "whose task does nothing (bench/noop_worker.py)",
    )
    a = ap.parse_args()
    against = dict(a.against)
    variant = settings_text(a.against)
    exit_on_sigterm()
    sim = ("--reasoning-parser", "qwen3", "--sim-step-ms", "5", "--sim-step-ms-per-req", "0.0")
    sim += ("--sim-mean-output-tokens", str(a.output_tokens))
    # every prompt short, max_tokens 2 by default: the jobs are all per-job cost
    k = Knobs(a.jobs, 0, a.max_tokens, a.max_tokens, 10_000, a.concurrency, 32, sim)
    print(f"machine: {machine()}")
    print(f"busy cores before the start: {wait_quiet():.2f} (waits up to 2 min for an idle machine)")
    rounds: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []  # --against, round by round
    floors: list[dict[str, Any]] = []  # --floor, round by round
    stream: list[float] = []
    with workdir(a.keep) as work, Children() as children:
        load = MachineLoad()
        data = write_dataset(work / f"{PARTITION}.jsonl", k)
        reqs = direct_requests(data, k)
        server = children.redis(work / "redis")
        client = redis.Redis.from_url(server.url)
        for rnd in range(1, a.rounds + 1):
            r = one_round(work, k, data, client, server.url, f"round-{rnd}", count=False)
            rounds.append(r)
            with Children() as ch:
                _, url = start_sim(ch, work / f"stream-{rnd}", k.sim)
                cpu, _tokens = stream_path(url, reqs, k.short_concurrency, "worker")
            stream.append(cpu / len(reqs))
            print(
                f"round {rnd}: worker {r['cpu_s']:.2f} CPU s for {a.jobs} jobs "
                f"({r['cpu_s'] / a.jobs * 1e3:.2f} ms each) in {r['wall_s']:.1f} s; "
                f"stream path {stream[-1] * 1e3:.2f} ms per request; by thread: {by_thread(r, a.jobs)}"
            )
            if against:
                b = one_round(work, k, data, client, server.url, f"against-{rnd}", False, None, against)
                others.append(b)
                print(
                    f"round {rnd}: worker with {variant}: {b['cpu_s'] / a.jobs * 1e3:.2f} ms "
                    f"a job, {b['cpu_s'] / r['cpu_s']:.2f}x the default's {r['cpu_s'] / a.jobs * 1e3:.2f}; "
                    f"by thread: {by_thread(b, a.jobs)}"
                )
            if a.floor:
                f = one_round(work, k, data, client, server.url, f"floor-{rnd}", False, floor=True)
                floors.append(f)
                print(
                    f"round {rnd}: Celery's floor (a task that does nothing): "
                    f"{f['cpu_s'] / a.jobs * 1e3:.2f} ms a message; by thread: {by_thread(f, a.jobs)}"
                )
        print(load.line())
        counted = one_round(work, k, data, client, server.url, "count", count=True)["trips"]
        if a.profile is not None:
            py_spy()
            one_round(work, k, data, client, server.url, "profile", count=False, profile=a.profile)
            print(f"py-spy profile of one run's worker (collapsed stacks): {a.profile}")
    per_job = median([r["cpu_s"] / a.jobs for r in rounds])
    per_stream = median(stream)
    where = f"one short worker (-c {a.concurrency}), median of {a.rounds}"
    print(f"\n{a.jobs} jobs of {a.max_tokens} tokens at most (the sim's mean {a.output_tokens}), {where}:")
    print(
        table(
            ["worker CPU ms / job", "stream path ms / request", "outside streaming ms / job"],
            [[f"{per_job * 1e3:.2f}", f"{per_stream * 1e3:.2f}", f"{(per_job - per_stream) * 1e3:.2f}"]],
        )
    )
    if against:
        ratios = [b["cpu_s"] / r["cpu_s"] for r, b in zip(rounds, others, strict=True)]
        print(
            f"with {variant}: {median([b['cpu_s'] / a.jobs for b in others]) * 1e3:.2f} ms of "
            f"worker CPU a job; against the default by round {', '.join(f'{x:.2f}x' for x in ratios)} "
            f"(median {median(ratios):.2f}x)"
        )
    if floors:
        floor = median([f["cpu_s"] / a.jobs for f in floors])
        print(
            f"Celery's floor (median of {len(floors)}): {floor * 1e3:.2f} ms of worker CPU a message; "
            f"tokenmill's own work on top of it: {(per_job - floor) * 1e3:.2f} ms a job "
            f"(of which the stream path {per_stream * 1e3:.2f})"
        )
    rows = [[n, f"{c / a.jobs:.2f}"] for n, c in counted.most_common()]
    rows.append(["all round trips", f"{sum(counted.values()) / a.jobs:.2f}"])
    print("\nRedis round trips per job (a separate run under MONITOR; the worker and its pump, the")
    print("enqueue and this process's polls left out; MULTI..EXEC counts once):")
    print(table(["command", "per job"], rows))


if __name__ == "__main__":
    main()
