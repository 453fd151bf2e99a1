"""Capacity-aware admission vs fixed concurrency, on a server whose KV capacity binds.

For each variant: a fresh private redis-server, a fresh server (the sim, or real SGLang 0.5.23
with ``--engine sglang``) with a small KV pool, one short worker started and ready, then the same
dataset enqueued; the wall time from the enqueue to the last commit, the server's retractions and
the highest KV it used. Variants:

- ``fixedN``: admission off, the worker's concurrency set to N by hand;
- ``directN``: no tokenmill at all: the direct asyncio client of ``bench/e2e.py`` at N requests
  at a time (what the worker's own overhead costs, apart from any admission policy);
- ``admission``: no concurrency set by hand (a large thread pool); admission decides.

Named sets for the sim: ``low`` (fixed 8), ``tuned`` (capacity / (prompt + mean output)),
``high`` (fixed 256). Retractions come from the sim's counters, or from SGLang's own log
(``KV cache pool is full. Retract requests. #retracted_reqs: N``).

    python bench/admission.py [--prompts 400] [--kv 24000] [--repeat 1] [--only tuned,admission] [--trace]
    python bench/admission.py --engine sglang [--only fixed8,fixed16,fixed32,fixed64,admission]

``--trace`` samples the server (running, queued, KV used) and the admission hash every 0.5 s and
prints each variant's timeline: where the time goes.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import redis
from _common import (
    Children,
    MachineLoad,
    exit_on_sigterm,
    machine,
    pin_clients,
    proc_cpu_s,
    start_sglang,
    start_sim,
    start_worker,
    tree_cpu_s,
    wait_for,
    wait_quiet,
    workdir,
)

from tokenmill import keys

RUN = "b"
PARTITION = "P"
RUN_KEYS = keys.RunKeys(RUN)
_RETRACT_RE = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")
_USED_RE = re.compile(r"#token: (\d+)")
_PREFILL_RE = re.compile(r"Prefill batch[^#]*#new-seq: (\d+)")
_DECODE_RE = re.compile(r"Decode batch[^#]*#running-req: (\d+)")


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def make_dataset(path: Path, n: int) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            row = {"id": str(i), "prompt": f"Write about topic {i}. " + "context " * (40 + i % 60)}
            fh.write(json.dumps(row) + "\n")
    return path


class Server:
    """The server of one variant, and what it reports."""

    def __init__(self, children: Children, where: Path, args: argparse.Namespace) -> None:
        self.engine = args.engine
        if self.engine == "sglang":
            kv = ("--max-total-tokens", str(args.kv))
            engine, self.url = start_sglang(children, where, *kv, split=args.split)
            self.pid, self.log = engine.pid, engine.log
        else:
            knobs = [
                "--max-total-tokens", str(args.kv), "--sim-mean-output-tokens", str(args.mean_output),
                "--sim-step-ms", str(args.step_ms), "--sim-step-ms-per-req", str(args.step_ms_per_req),
            ]  # fmt: skip
            sim, self.url = start_sim(children, where, knobs)
            self.pid, self.log = sim.pid, sim.log

    def load(self) -> tuple[int, int, int]:
        """(running, queued, KV tokens used) now."""
        if self.engine == "sim":
            st = get_json(f"{self.url}/_sim/stats")
            return int(st["running"]), int(st["queued"]), int(st["used_tokens"])
        loads = get_json(f"{self.url}/v1/loads")["loads"]
        return (
            sum(int(x["num_running_reqs"]) for x in loads),
            sum(int(x["num_waiting_reqs"]) for x in loads),
            sum(int(x["num_used_tokens"]) for x in loads),
        )

    def figures(self) -> dict[str, Any]:
        """What the server says of the run: its retractions and highest KV use; for SGLang (one
        read of its log) also its prefill batches and the requests each took in, and the mean
        running requests of the decode steps it logged (every 40th)."""
        if self.engine == "sim":
            st = get_json(f"{self.url}/_sim/stats")
            return {"retractions": int(st.get("retracted_total", 0)), "peak_kv": st.get("peak_used_tokens")}
        text = self.log.read_text(errors="replace")
        used = [int(m) for m in _USED_RE.findall(text)]
        seqs = [int(n) for n in _PREFILL_RE.findall(text)]
        running = [int(n) for n in _DECODE_RE.findall(text)]
        return {
            "retractions": sum(int(n) for n in _RETRACT_RE.findall(text)),
            "peak_kv": max(used, default=None),
            "prefills": len(seqs),
            "per_prefill": round(sum(seqs) / len(seqs), 1) if seqs else 0.0,
            "decode_running": round(statistics.fmean(running), 1) if running else 0.0,
        }


def sample_timeline(server: Server, client: redis.Redis, t0: float, stop: threading.Event) -> list[str]:
    """Every 0.5 s: elapsed, the server's running/queued/KV used, admission tokens held, slots."""
    rows: list[str] = []
    while not stop.wait(0.5):
        try:
            running, queued, used = server.load()
            held = client.hget(keys.admission_used(server.url), "total")  # unmanaged: keyed by URL
            slots = client.zcard(keys.admission(server.url))
        except Exception:
            continue
        rows.append(
            f"{time.monotonic() - t0:6.1f}s run {running:4d} queue {queued:4d} kv {used:6d} "
            f"| adm held {int(held or 0):6d} slots {slots:4d}"
        )
    return rows


def run_tokenmill(work: Path, data: Path, args: argparse.Namespace, *, admission: bool, threads: int) -> dict:
    from producer.enqueue import Enqueuer, Routing
    from tokenmill.ledger import Ledger

    with Children() as children:
        rds = children.redis(work / f"redis-{time.monotonic_ns()}")
        server = Server(children, work, args)
        env = {
            "TOKENMILL_REDIS_URL": rds.url,
            "TOKENMILL_SERVER_URL": server.url,
            "TOKENMILL_ADMISSION": "true" if admission else "false",
        }
        worker = start_worker(children, work, "short", threads, env)
        client = redis.Redis.from_url(rds.url)
        stop, timeline = threading.Event(), []
        t0 = time.monotonic()
        if args.trace:
            tracer = threading.Thread(
                target=lambda: timeline.extend(sample_timeline(server, client, t0, stop)), daemon=True
            )
            tracer.start()
        server0, worker0 = tree_cpu_s(server.pid), proc_cpu_s(worker.pid)
        routing = Routing(
            model="default", short_max_tokens=args.max_tokens, long_prompt_tokens=100_000, temperature=0.0
        )
        Enqueuer(Ledger(client, RUN), routing, max_queued=100_000).enqueue_file(data, PARTITION)
        wait_for(
            lambda: int(client.hget(RUN_KEYS.counts(), f"done|{PARTITION}") or 0) == args.prompts,
            args.timeout,
            "the run to finish",
        )
        wall = time.monotonic() - t0
        stop.set()
        if args.trace:
            tracer.join(5)
            print("\n".join(timeline), flush=True)
        figures = server.figures()
        return {
            "wall_s": round(wall, 2),
            "retractions": figures.pop("retractions"),
            "peak_kv": figures.pop("peak_kv"),
            "tokens": int(client.hget(RUN_KEYS.stats(), "completion_tokens") or 0),
            "worker_cpu_s": round(proc_cpu_s(worker.pid) - worker0, 1),
            "server_cpu_s": round(tree_cpu_s(server.pid) - server0, 1),
            **figures,
        }


def run_direct(work: Path, data: Path, args: argparse.Namespace, *, concurrency: int) -> dict:
    """The direct asyncio client of bench/e2e.py at ``concurrency``, on a fresh server."""
    from producer.enqueue import Routing
    from producer.readers import iter_records
    from producer.rows import normalize_row

    routing = Routing(
        model="default", short_max_tokens=args.max_tokens, long_prompt_tokens=100_000, temperature=0.0
    )
    reqs = []
    for rec in iter_records(data):
        spec = routing.spec(normalize_row(rec.source, rec.data), PARTITION, rec.source)
        reqs.append({"id": spec.job_id, "queue": "short", "request": spec.request})
    reqs_path, out = work / "direct-requests.json", work / f"direct-{time.monotonic_ns()}.json"
    reqs_path.write_bytes(orjson.dumps(reqs))
    with Children() as children:
        server = Server(children, work, args)
        e2e = str(Path(__file__).with_name("e2e.py"))
        argv = [sys.executable, e2e, "--direct-client", server.url, str(reqs_path), str(out),
                "--short-concurrency", str(concurrency)]  # fmt: skip
        server0 = tree_cpu_s(server.pid)
        child = children.spawn("direct", argv, work / "direct.log")
        wait_for(lambda: not child.alive(), args.timeout, "the direct client to finish", 0.1)
        if child.proc.returncode != 0:
            raise RuntimeError(f"the direct client failed:\n{child.output()[-3000:]}")
        doc = orjson.loads(out.read_bytes())
        figures = server.figures()
        return {
            "wall_s": round(doc["wall_s"], 2),
            "retractions": figures.pop("retractions"),
            "peak_kv": figures.pop("peak_kv"),
            "tokens": sum(t for t, _, _ in doc["outputs"].values()),
            "worker_cpu_s": round(doc["cpu_s"], 1),
            "server_cpu_s": round(tree_cpu_s(server.pid) - server0, 1),
            **figures,
        }


def variants(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(label, kind, concurrency) for each name in ``--only``."""
    tuned = max(1, args.kv // (90 + args.mean_output))
    named = {"low": args.low, "tuned": tuned, "high": args.high}
    out = []
    for name in (n.strip() for n in args.only.split(",")):
        if name == "admission":
            out.append((f"admission (threads {args.high}, no tuning)", "admission", args.high))
        elif name in named:
            out.append((f"fixed {named[name]} ({name})", "fixed", named[name]))
        elif m := re.fullmatch(r"(fixed|direct)(\d+)", name):
            kind = m[1]
            out.append((f"{kind} {m[2]}" + (" (direct client)" if kind == "direct" else ""), kind, int(m[2])))
        else:
            raise SystemExit(
                f"--only: unknown variant {name!r} (low, tuned, high, admission, fixedN, directN)"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("sim", "sglang"), default="sim")
    ap.add_argument(
        "--split",
        action="store_true",
        help="sglang: only the scheduler keeps its core; its front end and detokenizer share the "
        "clients' core (a diagnostic: the front end then competes with the client and sets the pace)",
    )
    ap.add_argument("--prompts", type=int, default=None, help="default 400 (sim), 96 (sglang)")
    ap.add_argument(
        "--kv", type=int, default=None, help="--max-total-tokens (default 24000 sim, 4000 sglang)"
    )
    ap.add_argument("--mean-output", type=int, default=300, help="the sim's mean output length")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 1024 (sim), 200 (sglang)")
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--step-ms-per-req", type=float, default=0.05)
    ap.add_argument("--low", type=int, default=8)
    ap.add_argument("--high", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--only", default=None, help="variants, comma-separated (see above)")
    ap.add_argument("--trace", action="store_true", help="print a 0.5 s timeline of each variant")
    args = ap.parse_args()
    exit_on_sigterm()
    real = args.engine == "sglang"
    args.prompts = args.prompts or (96 if real else 400)
    args.kv = args.kv or (4000 if real else 24000)
    args.max_tokens = args.max_tokens or (200 if real else 1024)
    args.only = args.only or (
        "fixed8,fixed16,fixed32,fixed64,admission" if real else "low,tuned,high,admission"
    )
    chosen = variants(args)
    results: dict[str, list[dict]] = {label: [] for label, _, _ in chosen}
    print(f"machine: {machine()}")
    if real:
        print(f"cores: {pin_clients()}")
        if args.split:
            print("       only SGLang's scheduler keeps its core; its front end and detokenizer share ours")
    print(f"busy cores before the start: {wait_quiet():.2f} (waits up to 2 min for an idle machine)")
    load = MachineLoad()
    with workdir(prefix="tm-bench-adm-") as work:
        data = make_dataset(work / f"{PARTITION}.jsonl", args.prompts)
        for _ in range(args.repeat):
            for label, kind, n in chosen:
                if kind == "direct":
                    r = run_direct(work, data, args, concurrency=n)
                else:
                    r = run_tokenmill(work, data, args, admission=kind == "admission", threads=n)
                results[label].append(r)
                print(f"  {label}: {r}", flush=True)
    print(load.line())
    report(args, results)


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    print(
        f"\nadmission benchmark ({args.engine}): {args.prompts} prompts, KV {args.kv} tokens, "
        f"max_tokens {args.max_tokens}, median of {args.repeat}"
    )
    med = {n: statistics.median(r["wall_s"] for r in rs) for n, rs in results.items()}
    fixed = {n: v for n, v in med.items() if n.startswith("fixed")}
    best = min(fixed, key=lambda n: fixed[n]) if fixed else None
    print(
        f"{'variant':44} {'wall s':>8} {'tok/s':>8} {'retractions':>12} {'peak KV':>8} {'vs best fixed':>14}"
    )
    for name, rs in results.items():
        tokens = statistics.median(r["tokens"] for r in rs)
        retr = statistics.median(r["retractions"] for r in rs)
        peak = max(r["peak_kv"] or 0 for r in rs)
        ratio = med[name] / fixed[best] if best else float("nan")
        print(f"{name:44} {med[name]:8.1f} {tokens / med[name]:8.0f} {retr:12.0f} {peak:8d} {ratio:14.3f}")
    adm = next((n for n in results if n.startswith("admission")), None)
    if adm and best:
        retr = statistics.median(r["retractions"] for r in results[adm])
        best_retr = statistics.median(r["retractions"] for r in results[best])
        print(
            f"\nadmission / best fixed ({best}) = {med[adm] / fixed[best]:.3f}; retractions {retr:.0f} "
            f"vs {best_retr:.0f}; worst fixed / admission = {max(fixed.values()) / med[adm]:.2f}x"
        )


if __name__ == "__main__":
    main()
