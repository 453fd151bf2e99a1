"""Reference cost per sampled job (issue 56): what judging a run against a reference server costs.

The same prompts, alternating A B A B, each run on a fresh sim through one fresh real ``short``
worker (``--concurrency 150``, default settings) on a private redis-server:

- A: the run alone, no reference;
- B: the same prompts in another run whose reference is a second sim, every job sampled
  (``--quality-sample 1.0``, as ``tokenmill enqueue --quality-reference URL`` stores it),
  measured until every sampled job is scored (``quality_drift.drift_view``: ``n`` + ``skipped``
  reach ``sampled``, with a deadline).

Per round and median: the worker process's CPU (/proc) per job, from ready and idle to the last
commit (A) or to the last job scored (B), and B/A; the extra worker CPU per sampled job
((B - A) / sampled), also net of the idle worker's own CPU over the scoring lag (its rate is
read for ``IDLE_S`` after each run); the reference's requests per sampled job (from its access
log, whose chat count is checked against ``/_sim/stats``' ``chat_requests``); the scoring lag
(the run's last commit to its last job scored: one scorer a run, one request at a time); and
each run's own wall (first enqueue to last commit; scoring must not slow it: B/A ~1).

The reference sim answers faster (``--ref-step-ms``) than the run's, as a spare server would;
the lag scales with its speed, the worker's CPU does not.

    .venv/bin/python bench/quality.py                 # 300 jobs, 3 rounds A B: ~5 min
    .venv/bin/python bench/quality.py --jobs 20 --rounds 1    # a check: ~1 min
"""

from __future__ import annotations

import argparse
import functools
import re
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import redis
from _common import (
    Children,
    MachineLoad,
    exit_on_sigterm,
    machine,
    median,
    proc_cpu_s,
    start_sim,
    start_worker,
    table,
    wait_for,
    wait_quiet,
    workdir,
)
from e2e import PARTITION, Knobs, routing, write_dataset

from tokenmill import keys
from tokenmill import quality_drift as qd

IDLE_S = 2.0  # the worker's idle CPU rate is read over this long after each run
PATHS = {"/v1/chat/completions": "chat", "/v1/tokenize": "tokenize", "/generate": "generate"}  # the scorer's
REQUEST_RE = re.compile(f'"POST ({"|".join(PATHS)}) HTTP')


def reference_requests(log: Path, offset: int, url: str) -> Counter[str]:
    """The reference's scoring requests since ``offset`` of its log, by path."""
    with open(log, "rb") as fh:
        fh.seek(offset)
        counted = Counter(REQUEST_RE.findall(fh.read().decode(errors="replace")))
    with urllib.request.urlopen(f"{url}/_sim/stats", timeout=10) as resp:
        chats = orjson.loads(resp.read())["chat_requests"]
    assert counted["/v1/chat/completions"] == chats, f"{counted} in the log, {chats} chats in /_sim/stats"
    return counted


def one_run(
    work: Path, k: Knobs, ref_sim: tuple[str, ...], data: Path, client: redis.Redis, redis_url: str,
    name: str, reference: bool, timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    """One run of every prompt through a fresh worker; with ``reference``, judged on a second sim."""
    from producer.enqueue import Enqueuer
    from tokenmill.ledger import Ledger

    client.flushall()
    where = work / name
    with Children() as ch:
        _sim, url = start_sim(ch, where, k.sim)
        env = {"TOKENMILL_REDIS_URL": redis_url, "TOKENMILL_SERVER_URL": url,
               "TOKENMILL_RESULTS_URL": str(where / "results")}  # fmt: skip
        worker = start_worker(ch, where, "short", k.short_concurrency, env)
        ledger = Ledger(client, name)
        if reference:  # before the first commit: the worker reads a new run's reference once
            ref, ref_url = start_sim(ch, where, (*ref_sim, "--log-level", "info"), "reference")
            offset = ref.log.stat().st_size
            qd.store(client, name, qd.Reference(ref_url, 1.0, 0))
        time.sleep(1.0)  # let the worker's start-up work (upkeep, loadwatch) settle
        done_field, counts_key = keys.count_field("done", PARTITION), keys.RunKeys(name).counts()

        def finished() -> bool:
            if not worker.alive():
                raise RuntimeError(f"the worker died:\n{worker.output()[-2000:]}")
            return int(client.hget(counts_key, done_field) or 0) >= k.prompts

        def scored() -> dict[str, Any] | None:
            v = qd.drift_view(client, name).get(PARTITION)
            done = v is not None and v["sampled"] >= k.prompts and v["n"] + v["skipped"] >= v["sampled"]
            return v if done and finished() else None

        cpu0 = proc_cpu_s(worker.pid)
        start = time.time()
        enq = Enqueuer(ledger, routing(k), max_queued=100_000)
        enq.enqueue_file(data, PARTITION)
        assert enq.summary.total_new == k.prompts, enq.summary.line(name)
        wait_for(finished, 900, f"{name}'s jobs to finish")
        view = wait_for(scored, timeout_s, f"{name}'s sampled jobs to be scored") if reference else {}
        end = time.time()
        cpu = proc_cpu_s(worker.pid) - cpu0
        time.sleep(IDLE_S)
        idle = (proc_cpu_s(worker.pid) - cpu0 - cpu) / IDLE_S
        if ledger.counts()[PARTITION]["failed"]:
            raise RuntimeError(f"{name}: jobs failed: see the worker's log in {where}")
        last = max(int(ms or 0) for _, (ms,) in ledger.iter_jobs(PARTITION, ["done_ms"])) / 1000
        requests = reference_requests(ref.log, offset, ref_url) if reference else Counter()
    return {"cpu": cpu, "idle": idle, "wall": last - start, "lag": end - last if reference else 0.0,
            "view": view, "requests": requests}  # fmt: skip


COLUMNS = {  # figure: (header, format)
    "cpu_a": ("A CPU ms/job", ".2f"), "cpu_b": ("B CPU ms/job", ".2f"), "cpu_x": ("B/A", ".2f"),
    "extra": ("extra ms/sampled", ".2f"), "net": ("net of idle", ".2f"), "idle": ("idle ms/s", ".1f"),
    **{p: (f"ref {name}/sampled", ".2f") for p, name in PATHS.items()},
    "wall_a": ("A wall s", ".2f"), "wall_b": ("B wall s", ".2f"), "wall_x": ("B/A wall", ".2f"),
    "lag": ("lag s", ".2f"), "lag_per": ("lag ms/sampled", ".0f"),
}  # fmt: skip


def figures(ra: dict[str, Any], rb: dict[str, Any], jobs: int) -> dict[str, float]:
    """A round's figures (:data:`COLUMNS`) from its runs A and B."""
    n = rb["view"]["sampled"]
    extra = (rb["cpu"] - ra["cpu"]) / n
    return {
        "cpu_a": ra["cpu"] / jobs * 1e3, "cpu_b": rb["cpu"] / jobs * 1e3, "cpu_x": rb["cpu"] / ra["cpu"],
        "extra": extra * 1e3, "net": (extra - rb["idle"] * rb["lag"] / n) * 1e3, "idle": rb["idle"] * 1e3,
        **{p: rb["requests"][p] / n for p in PATHS},
        "wall_a": ra["wall"], "wall_b": rb["wall"], "wall_x": rb["wall"] / ra["wall"],
        "lag": rb["lag"], "lag_per": rb["lag"] / n * 1e3,
    }  # fmt: skip


def row(label: str, f: dict[str, float]) -> list[str]:
    return [label, *(format(f[c], fmt) for c, (_, fmt) in COLUMNS.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="A B rounds; medians are reported (default 3)")
    ap.add_argument("--concurrency", type=int, default=150)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--mean-output-tokens", type=int, default=170, help="the sims' mean output length")
    ap.add_argument("--step-ms", type=float, default=20.0, help="the run's sim: decode step time")
    ap.add_argument("--ref-step-ms", type=float, default=1.0, help="the reference sim's decode step time")
    ap.add_argument("--score-timeout", type=float, default=900.0, help="seconds B waits for its scores")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (logs)")
    a = ap.parse_args()
    exit_on_sigterm()
    common = ("--reasoning-parser", "qwen3", "--sim-mean-output-tokens", str(a.mean_output_tokens))
    sim = (*common, "--sim-step-ms", str(a.step_ms), "--sim-step-ms-per-req", "0.02")
    ref_sim = (*common, "--sim-step-ms", str(a.ref_step_ms), "--sim-step-ms-per-req", "0.0")
    k = Knobs(a.jobs, 0, a.max_tokens, a.max_tokens, 10_000, a.concurrency, 32, sim)
    print(f"machine: {machine()}")
    print(f"run's sim: {' '.join(sim)}\nreference sim: {' '.join(ref_sim)}")
    print(f"busy cores before the start: {wait_quiet():.2f} (waits up to 2 min for an idle machine)")
    rounds: list[dict[str, float]] = []
    with workdir(a.keep) as work, Children() as children:
        load = MachineLoad()
        data = write_dataset(work / f"{PARTITION}.jsonl", k)
        server = children.redis(work / "redis")
        client = redis.Redis.from_url(server.url)
        run = functools.partial(
            one_run, work, k, ref_sim, data, client, server.url, timeout_s=a.score_timeout
        )
        for rnd in range(1, a.rounds + 1):
            ra, rb = run(f"quality-a-{rnd}", False), run(f"quality-b-{rnd}", True)
            rounds.append(figures(ra, rb, a.jobs))
            v = rb["view"]
            print(
                f"round {rnd}: " + ", ".join(f"{h} {rounds[-1][c]:{fmt}}" for c, (h, fmt) in COLUMNS.items())
            )
            print(f"  B: {v['sampled']} sampled, {v['n']} scored, {v['skipped']} skipped, drift {v['drift']}")
        print(load.line())
    med = {c: median([f[c] for f in rounds]) for c in COLUMNS}
    print(f"\n{a.jobs} jobs, one short worker (-c {a.concurrency}); A: no reference, B: every job judged")
    print("(worker process CPU; extra: (B - A) per sampled job, also net of its idle CPU over the lag; ref:")
    print("reference requests; lag: last commit to last scored; wall: first enqueue to last commit)")
    rows = [row(f"round {i}", f) for i, f in enumerate(rounds, 1)]
    print(table(["", *(h for h, _ in COLUMNS.values())], [*rows, row("median", med)]))


if __name__ == "__main__":
    main()
