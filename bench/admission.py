"""Capacity-aware admission vs fixed concurrency, on a sim whose KV capacity binds.

For each variant: a fresh private redis-server, a fresh sim with a small KV pool, the same
dataset enqueued, one short worker; the wall time from enqueue to the last commit, and the sim's
retraction count. Fixed variants turn admission off and set the worker's concurrency (too low,
hand-tuned from the capacity, too high); the admission variant sets no concurrency by hand (the
worker's thread pool is large) and lets the server's published capacity bound the load.

    python bench/admission.py [--prompts 400] [--kv 24000] [--repeat 1] [--only tuned,admission]
                              [--trace]

The summary gives the median wall time and retractions and the highest KV the sim used (its
``--max-total-tokens`` is the limit). ``--trace`` samples the sim (running, queued, KV used) and
the admission hash (tokens held, slots) every 0.5 s and prints the timeline of each variant:
where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import redis
from _common import ROOT, Children, proc_cpu_s, start_sim, start_worker, wait_for, workdir

from tokenmill import keys

RUN = "b"
RUN_KEYS = keys.RunKeys(RUN)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def make_dataset(path: Path, n: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(
                json.dumps({"id": str(i), "prompt": f"Write about topic {i}. " + "context " * (40 + i % 60)})
                + "\n"
            )


def sample_timeline(url: str, client: redis.Redis, t0: float, stop: threading.Event) -> list[str]:
    """Every 0.5 s: elapsed, sim running/queued/KV used, admission tokens held and slots."""
    rows: list[str] = []
    while not stop.wait(0.5):
        try:
            st = get_json(f"{url}/_sim/stats")
            # an unmanaged server's admission is kept under its URL
            held = client.hget(keys.admission_used(url), "total")
            slots = client.zcard(keys.admission(url))
        except Exception:
            continue
        rows.append(
            f"{time.monotonic() - t0:6.1f}s run {st['running']:4d} queue {st['queued']:4d} "
            f"kv {st['used_tokens']:6d} ratio {st['new_token_ratio']:.3f} "
            f"retr {st['retracted_total']:4d} | adm held {int(held or 0):6d} slots {slots:4d}"
        )
    return rows


def run_variant(
    work: Path, data: Path, args: argparse.Namespace, *, admission: bool, concurrency: int
) -> dict:
    with Children() as children:
        rds = children.redis(work / f"redis-{time.monotonic_ns()}")
        knobs = [
            "--max-total-tokens", str(args.kv), "--sim-mean-output-tokens", str(args.mean_output),
            "--sim-step-ms", str(args.step_ms), "--sim-step-ms-per-req", str(args.step_ms_per_req),
        ]  # fmt: skip
        sim, url = start_sim(children, work, knobs)
        env = {
            "TOKENMILL_REDIS_URL": rds.url,
            "TOKENMILL_SERVER_URL": url,
            "TOKENMILL_ADMISSION": "true" if admission else "false",
        }
        enqueue = [
            sys.executable, "-m", "tokenmill.cli", "enqueue", str(data), "--run", RUN,
            "--short-max-tokens", str(args.max_tokens), "--long-prompt-tokens", "100000",
        ]  # fmt: skip
        subprocess.run(enqueue, env={**os.environ, **env}, cwd=ROOT, check=True, capture_output=True)
        t0 = time.monotonic()  # the worker's start-up counts, in every variant alike
        worker = start_worker(children, work, "short", concurrency, env)
        client = redis.Redis.from_url(rds.url)
        stop = threading.Event()
        timeline: list[str] = []
        if args.trace:
            tracer = threading.Thread(
                target=lambda: timeline.extend(sample_timeline(url, client, t0, stop)), daemon=True
            )
            tracer.start()
        wait_for(
            lambda: int(client.hget(RUN_KEYS.counts(), "done|" + data.stem) or 0) == args.prompts,
            args.timeout,
            "the run to finish",
        )
        wall = time.monotonic() - t0
        stop.set()
        if args.trace:
            tracer.join(5)
            print("\n".join(timeline), flush=True)
        stats = get_json(f"{url}/_sim/stats")
        return {
            "wall_s": wall,
            "retractions": stats.get("retracted_total", 0),
            "peak_kv": stats.get("peak_used_tokens"),
            "tokens": int(client.hget(RUN_KEYS.stats(), "completion_tokens") or 0),
            "worker_cpu_s": round(proc_cpu_s(worker.pid), 1),
            "sim_cpu_s": round(proc_cpu_s(sim.pid), 1),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--kv", type=int, default=24000, help="the sim's --max-total-tokens")
    ap.add_argument("--mean-output", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--step-ms-per-req", type=float, default=0.05)
    ap.add_argument("--low", type=int, default=8)
    ap.add_argument("--high", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--only", default="low,tuned,high,admission", help="variants to run, comma-separated")
    ap.add_argument("--trace", action="store_true", help="print a 0.5 s timeline of each variant")
    args = ap.parse_args()
    # Hand-tuned the way it was done by hand: capacity / (prompt + typical output).
    tuned = max(1, args.kv // (90 + args.mean_output))
    every = {
        "low": (f"fixed {args.low} (too low)", False, args.low),
        "tuned": (f"fixed {tuned} (hand-tuned)", False, tuned),
        "high": (f"fixed {args.high} (too high)", False, args.high),
        "admission": (f"admission (threads {args.high}, no tuning)", True, args.high),
    }
    variants = [every[k.strip()] for k in args.only.split(",")]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    with workdir(prefix="tm-bench-adm-") as work:
        data = work / "P.jsonl"
        make_dataset(data, args.prompts)
        for _ in range(args.repeat):
            for name, adm, conc in variants:
                results[name].append(run_variant(work, data, args, admission=adm, concurrency=conc))
                print(f"  {name}: {results[name][-1]}", flush=True)
    print(
        f"\nadmission benchmark: {args.prompts} prompts, KV {args.kv} tokens, "
        f"mean output {args.mean_output}, max_tokens {args.max_tokens}, median of {args.repeat}"
    )
    med = {n: statistics.median(r["wall_s"] for r in rs) for n, rs in results.items()}
    fixed = [v for n, v in med.items() if n.startswith("fixed")] or [float("nan")]
    best_fixed, worst_fixed = min(fixed), max(fixed)
    print(
        f"{'variant':44} {'wall s':>8} {'tok/s':>8} {'retractions':>12} {'peak KV':>8} {'vs best fixed':>14}"
    )
    for name, rs in results.items():
        tokens = statistics.median(r["tokens"] for r in rs)
        retr = statistics.median(r["retractions"] for r in rs)
        peak = max(r["peak_kv"] or 0 for r in rs)
        ratio = med[name] / best_fixed
        print(f"{name:44} {med[name]:8.1f} {tokens / med[name]:8.0f} {retr:12.0f} {peak:8d} {ratio:14.3f}")
    adm = med[variants[-1][0]]
    print(
        f"\nadmission / best fixed = {adm / best_fixed:.3f} (target <= 1.05); "
        f"worst fixed / admission = {worst_fixed / adm:.2f}x"
    )


if __name__ == "__main__":
    main()
