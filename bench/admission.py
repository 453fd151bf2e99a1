"""Capacity-aware admission vs fixed concurrency, on a server whose KV capacity binds.

For each variant: a fresh private redis-server, a server with a small KV pool (a fresh sim; or
real SGLang 0.5.23 with ``--engine sglang``, started once for all the runs of a cell and flushed
between them, or fresh for each run with ``--server-per-run``), one short worker started and
ready, then the same dataset enqueued; the wall time from the enqueue to the last commit, the
server's retractions and the highest KV it used. Variants:

- ``fixedN``: admission off, the worker's concurrency set to N by hand;
- ``directN``: no tokenmill at all: the direct asyncio client of ``bench/e2e.py`` at N requests
  at a time (what the worker's own overhead costs, apart from any admission policy);
- ``admission``: no concurrency set by hand (a large thread pool); admission decides;
- ``against``: admission again, its workers run from another copy of the source (``--against
  DIR``, a git worktree of another commit): two versions of the policy side by side in one run;
- ``placeboN``: fixed N again under another name, judged as admission is: the ratio a variant
  that *is* a fixed setting gets, so the verdict's noise floor on this host;
- ``oracle``: admission told at the start what a cold start cannot know: the lifetime and the
  highest window the cell's last ``admission`` run reached (written into the admission hash
  before the enqueue, as if a watcher had just set them, the window also its cap), so it paces
  from the first request. Not a product setting: an upper bound on what a better cold start
  could gain (``--only`` must name ``admission`` before it).

Named sets for the sim: ``low`` (fixed 8), ``tuned`` (capacity / (prompt + mean output)),
``high`` (fixed 256). Retractions come from the sim's counters, or from SGLang's own log
(``KV cache pool is full. Retract requests. #retracted_reqs: N``).

    python bench/admission.py [--prompts 400] [--kv 24000] [--repeat 1] [--only tuned,admission] [--trace]
    python bench/admission.py --engine sglang [--only fixed8,fixed16,fixed32,fixed64,admission]

``--trace`` samples the server (running, queued, KV used) and the admission hash (window, pace,
lifetime, the young size and mean use the pacing rule sizes requests by) every 0.5 s and prints
each variant's timeline: where the time goes.

``--matrix`` runs the workload matrix of issue 26 (see ``CELLS``; on real SGLang the outputs of
the early-stop and mixed-outputs cells end at stop tokens, see ``SGLANG_STOPS``): a base cell, the issue's
workload (96 short prompts, outputs that run to ``max_tokens`` 200, a 4,000-token KV pool, a cold
start, one worker of 64 threads; the sim's steps timed as real SGLang's on these CPUs, see
``SIM_STEPS``), and one cell per other value of each axis; each cell runs fixed
8/16/32/64 and admission in alternating rounds (3 unless ``--repeat``) and prints a table with
each one's median wall time, retractions and mean running requests (SGLang's decode steps;
the sim sampled every 0.25 s), on SGLang its forward passes (decode steps + prefill batches, from
its log: the server's work, which the host's speed does not move), and the verdicts of the issue's
item 2. On SGLang the verdicts are given again at the runs' common host speed: this host's speed
drifts by up to a third from one run to the next, and SGLang's log (stamped to the millisecond
here) times every decode step, so each run's wall is divided by how slowly the host ran its steps,
batch size by batch size, against the cell's other runs (``host_speeds`` in ``_common.py``; a
step of more requests costs more, so fewer passes are not the whole story). What the correction
cannot tell from the host: anything that slows SGLang's steps because of the variant itself, such
as the load watch's reads on the core SGLang's front end shares with its scheduler; the front
end's CPU (``front_cpu_s``) shows that. ``--lock FILE`` holds a
flock around each run (around each cell while one real server serves it), for a machine that
others share.

    python bench/admission.py --matrix all --lock /tmp/tokenmill-heavy.lock
    python bench/admission.py --engine sglang --matrix base,long-prompts,roomy-kv,warm,workers-2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import redis
from _common import (
    ROOT,
    Children,
    MachineLoad,
    SglangLog,
    exit_on_sigterm,
    heavy,
    host_speeds,
    machine,
    pin_clients,
    proc_cpu_s,
    start_sglang,
    start_sim,
    start_worker,
    table,
    tree_cpu_s,
    verdict,
    wait_for,
    wait_quiet,
    workdir,
)

from tokenmill import keys
from tokenmill.admission_view import admission_view

RUN = "b"
WARM_RUN = "w"  # the warm-up run of a warm start, in the same Redis and on the same server
PARTITION = "P"


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def make_dataset(path: Path, n: int, style: str = "long", lead: str = "") -> Path:
    """``n`` prompts: ``long`` ones of ~90-210 tokens, or ``short`` ones (the question of issue 26
    repeated 1-6 times, ~10-60 tokens); ``lead`` starts every prompt (a warm-up run's prompts must
    differ from the measured ones, or SGLang's prefix cache would serve them)."""
    with path.open("w") as fh:
        for i in range(n):
            if style == "short":
                text = f"Question {i}: why is the sky blue" + " why is the sky blue" * (i % 6)
            else:
                text = f"Write about topic {i}. " + "context " * (40 + i % 60)
            fh.write(json.dumps({"id": str(i), "prompt": lead + text}) + "\n")
    return path


class Server:
    """The server of one variant (or, shared, of a cell's variants one after another), and what it
    reports of the work since :meth:`begin`."""

    def __init__(self, children: Children, where: Path, args: argparse.Namespace) -> None:
        self.engine = args.engine
        self.since = 0  # where in its log the variant's work starts
        if self.engine == "sglang":
            # --enable-metrics: the closed loop reads the retractions from /metrics, as a managed
            # server's manager counts them from its log; --enable-cache-report: usage states the
            # prompt tokens served from the prefix cache, which admission's prompt offset nets
            # --decode-log-interval 1: a decode line every step, so the log counts the server's
            # forward passes (decode steps + prefill batches), a figure the host's speed does not move
            flags = ("--max-total-tokens", str(args.kv), "--enable-metrics", "--decode-log-interval", "1")
            if args.cache_report:
                flags += ("--enable-cache-report",)
            engine, self.url = start_sglang(children, where, *flags, split=args.split)
            self.pid, self.log = engine.pid, engine.log
        else:
            knobs = [
                "--max-total-tokens", str(args.kv), "--sim-mean-output-tokens", str(sim_output(args)),
                "--enable-metrics",  # the closed loop reads the retractions from /metrics
                "--sim-step-ms", str(args.step_ms), "--sim-step-ms-per-req", str(args.step_ms_per_req),
            ]  # fmt: skip
            sim, self.url = start_sim(children, where, knobs)
            self.pid, self.log = sim.pid, sim.log

    def begin(self, deadline_s: float = 60.0) -> None:
        """Ready a shared SGLang for the next variant as a fresh one would be: idle, its prefix
        cache flushed (``/flush_cache`` answers 400 while requests are in flight; an idle
        scheduler also resets its new-token ratio by itself), its log read from here on."""
        if self.engine != "sglang":
            return
        wait_for(self._flushed, deadline_s, f"{self.url} to be idle and flush its cache", 0.2)
        self.mark()

    def _flushed(self) -> bool:
        """One ``/flush_cache``: True when done, False while requests are in flight (400)."""
        try:
            req = urllib.request.Request(f"{self.url}/flush_cache", method="POST")
            with urllib.request.urlopen(req, timeout=10):
                return True
        except urllib.error.HTTPError as exc:
            if exc.code != 400:
                raise
            return False

    def mark(self) -> None:
        """What the server reports from here on (after a warm-up run: the measured run's work)."""
        if self.engine == "sglang":
            self.since = self.log.stat().st_size

    def warm_up(self) -> None:
        """A few short requests, so that the first variant on a new server does not pay for its
        first batches alone."""
        body = json.dumps(
            {"model": "default", "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 32}
        ).encode()
        for _ in range(4):
            req = urllib.request.Request(
                f"{self.url}/v1/chat/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                resp.read()

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
        read of its log) also its prefill batches and the requests each took in, the mean running
        requests of its decode steps, and its forward passes (decode steps + prefill batches: it
        logs every step)."""
        if self.engine == "sim":
            st = get_json(f"{self.url}/_sim/stats")
            return {"retractions": int(st.get("retracted_total", 0)), "peak_kv": st.get("peak_used_tokens")}
        log = SglangLog.since(self.log, self.since)
        seqs, running = log.prefill_seqs, log.decode_running
        return {
            "retractions": log.retractions,
            "peak_kv": log.peak_kv,
            "prefills": len(seqs),
            "per_prefill": round(sum(seqs) / len(seqs), 1) if seqs else 0.0,
            "decode_running": round(statistics.fmean(running), 1) if running else 0.0,
            "passes": len(running) + len(seqs),
            "steps": log.decode_steps,
        }


def sim_output(args: argparse.Namespace) -> int:
    """The sim's mean natural output length for ``--outputs`` (the sim's lengths spread uniformly
    over 0.25-1.75 of the mean): ``max`` every output reaches max_tokens, ``early`` every one stops
    at 15-105% of half of it, ``mix`` half of them reach it."""
    if args.mean_output is not None:
        return int(args.mean_output)
    return {"max": 4 * args.max_tokens, "early": args.max_tokens // 2, "mix": args.max_tokens}[args.outputs]


# of the admission hash
TRACED = (
    "total", "n", "window", "rule", "pace_ms", "life_ms", "life_dev",
    "use_min", "use_sum", "use_n", "young_fit", "len_mean", "len_dev",
)  # fmt: skip


def mean_use(use_sum: str, use_n: str) -> str:
    """The mean use over time admission saw (policy.py's ``use_sum`` / ``use_n``)."""
    return "-" if "-" in (use_sum, use_n) or float(use_n) <= 0 else f"{float(use_sum) / float(use_n):.0f}"


class Sampler(threading.Thread):
    """Every 0.25 s: the server's running/queued/KV used and the admission window, for the mean
    running requests of a run and (``--trace``) its timeline, printed every other sample."""

    def __init__(self, server: Server, client: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.server, self.client = server, client
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.running: list[int] = []
        self.rows: list[str] = []
        self.windows: list[int] = []
        self.life_ms = 0.0

    def run(self) -> None:
        used_key = keys.admission_used(self.server.url)  # an unmanaged server is keyed by its URL
        while not self.stop.wait(0.25):
            try:
                running, queued, used = self.server.load()
                f = self.client.hmget(used_key, *TRACED)
            except Exception:
                continue
            self.running.append(running)
            held, n, window, rule, pace, life, dev, use_min, use_sum, use_n, fit, length, length_dev = (
                x.decode() if x else "-" for x in f
            )
            if window != "-" and rule == "window":
                self.windows.append(int(window))
            if life != "-":
                self.life_ms = float(life)
            life, dev, young, fit, length, length_dev = (
                v if v == "-" else f"{float(v):.0f}" for v in (life, dev, use_min, fit, length, length_dev)
            )
            self.rows.append(
                f"{time.monotonic() - self.t0:6.2f}s run {running:3d} queue {queued:3d} kv {used:6d} "
                f"| adm in flight {n:>3} window {window:>3} rule {rule:6} held {held:>6} pace {pace:>4} ms"
                f" life {life:>5} ± {dev:>4} ms, output {length:>4} ± {length_dev:>3}"
                f" | young {young:>4} mean {mean_use(use_sum, use_n):>4} fitted {fit:>4}"
            )

    def admission(self) -> dict[str, Any]:
        """What admission reached: its highest window and last lifetime (what ``oracle`` is told),
        and the requests the tail rule started together with the rest of the run (admit.lua)."""
        tailed = int(admission_view(self.client, self.server.url).get("tailed", 0))
        if not self.windows:
            return {"tailed": tailed}
        return {"window_max": max(self.windows), "life_ms": round(self.life_ms), "tailed": tailed}

    def mean_running(self) -> float:
        busy = [r for r in self.running if r > 0]
        return round(statistics.fmean(busy), 1) if busy else 0.0


def run_tokenmill(
    work: Path,
    data: Path,
    args: argparse.Namespace,
    *,
    admission: bool,
    threads: int,
    paced: bool = True,
    group: int | None = None,
    shared: Server | None = None,
    oracle: tuple[int, float] | None = None,
    source: Path = ROOT,
) -> dict:
    """One variant: ``args.workers`` workers (fixed: ``threads`` split among them; admission:
    ``threads`` each; ``paced``: admission_pacing; ``group``: admission_pace_group; ``oracle``:
    the window and lifetime admission is told at the start; ``source``: the copy of the source the
    workers run from), after a warm-up run of the dataset
    under another run id when ``args.warm``; on ``shared`` if given, else on a server of its
    own."""
    with Children() as children:
        rds = children.redis(work / f"redis-{time.monotonic_ns()}")
        server = shared or Server(children, work, args)
        server.begin()
        env = {
            "TOKENMILL_REDIS_URL": rds.url,
            "TOKENMILL_SERVER_URL": server.url,
            "TOKENMILL_ADMISSION": "true" if admission else "false",
            "TOKENMILL_ADMISSION_PACING": "true" if paced else "false",
        }
        if group is not None:
            env["TOKENMILL_ADMISSION_PACE_GROUP"] = str(group)
        each = threads if admission else max(1, threads // args.workers)
        workers = [
            start_worker(children, work, "short", each, env, source=source) for _ in range(args.workers)
        ]
        client = redis.Redis.from_url(rds.url)
        if args.warm:
            warm = make_dataset(
                work / f"warm-{time.monotonic_ns()}.jsonl", args.prompts, args.prompt_style, "Earlier: "
            )
            enqueue_and_wait(client, warm, args, WARM_RUN)
            server.mark()  # the passes and KV of the measured run alone
        sampler = Sampler(server, client)
        sampler.start()
        server0, worker0 = tree_cpu_s(server.pid), sum(proc_cpu_s(w.pid) for w in workers)
        front0 = proc_cpu_s(server.pid)  # SGLang's main process: its HTTP front end, tokenizer manager
        retr0 = server.figures()["retractions"]
        if oracle:
            tell(client, server.url, *oracle)
        wall = enqueue_and_wait(client, data, args, RUN)
        sampler.stop.set()
        sampler.join(5)
        if args.trace:
            print("\n".join(sampler.rows[1::2]), flush=True)
        figures = server.figures()
        return {
            "wall_s": round(wall, 2),
            **job_timing(client, args.max_tokens),
            "retractions": figures.pop("retractions") - retr0,
            "peak_kv": figures.pop("peak_kv"),
            "tokens": int(client.hget(keys.RunKeys(RUN).stats(), "completion_tokens") or 0),
            "mean_running": sampler.mean_running(),
            **(sampler.admission() if admission else {}),
            "worker_cpu_s": round(sum(proc_cpu_s(w.pid) for w in workers) - worker0, 1),
            "server_cpu_s": round(tree_cpu_s(server.pid) - server0, 1),
            # of which the front end's, which shares the scheduler's core here and also serves the
            # load watch's reads (/v1/loads, /metrics) under admission
            "front_cpu_s": round(proc_cpu_s(server.pid) - front0, 2),
            **figures,
        }


def tell(client: redis.Redis, url: str, window: int, life_ms: float) -> None:
    """The ``oracle`` variant: a fresh window of ``window`` (also the pacing rule's cap) and a
    lifetime of ``life_ms`` (of requests alike: spread 0) on the server's admission hash, the
    pool taken as binding, as if its watcher had just set them; fresh for six polls, and kept
    fresh by the watcher from its first figures on."""
    seconds, micros = client.time()
    client.hset(
        keys.admission_used(url),
        mapping={
            "window": window,
            "window_ms": seconds * 1000 + micros // 1000,
            "paced_cap": window,
            "life_ms": life_ms,
            "life_dev": 0,
            "bound": 1,
        },
    )


def job_timing(client: redis.Redis, max_tokens: int) -> dict[str, float]:
    """From the run's job hashes: the median gap between a job's claim and the last end before it
    (for jobs claimed after the first end: how long a freed place waited for its successor, the
    worker's turnaround), the median time to first token (the server's queue and prefill), the
    mean output length and how many outputs reached ``max_tokens``."""
    run = keys.RunKeys(RUN)
    ids = [x.decode() for x in client.lrange(run.jobs(PARTITION), 0, -1)]
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(run.job(job_id), "claimed_ms", "done_ms", "result")
    results = [(int(c), int(d), orjson.loads(r)) for c, d, r in pipe.execute() if c and d and r]
    rows = [(c, d, r.get("ttft_s")) for c, d, r in results]
    lengths = [int(r["usage"]["completion_tokens"]) for _, _, r in results]
    ends = sorted(d for _, d, _ in rows)
    gaps = []
    for claimed, _, _ in rows:
        before = [d for d in ends if d <= claimed]
        if before:
            gaps.append(claimed - before[-1])
    ttfts = [t * 1000 for _, _, t in rows if t is not None]
    return {
        "refill_ms": round(statistics.median(gaps), 1) if gaps else 0.0,
        "ttft_ms": round(statistics.median(ttfts), 1) if ttfts else 0.0,
        "mean_output": round(statistics.fmean(lengths), 1) if lengths else 0.0,
        "at_max": sum(n >= max_tokens for n in lengths),
    }


# Real SGLang's outputs for ``--outputs early`` and ``mix``: the tiny model's random weights
# practically never end an output, so the run asks SGLang to stop at some of the tokens it emits
# (greedy, so every variant gets the same lengths: measured the same at 8 and 64 at a time). For
# the 96 short prompts of the matrix on the model of ``make sglang-env`` (``--random-seed 0``),
# with ``max_tokens`` 200: ``early`` ends them at 21-200 tokens, mean 104, 10 of 96 at 200 (the
# sim's: 25-175, mean 100); ``mix`` at 24-200, mean 157, 51 of 96 at 200 (the sim's: half at 200,
# mean 162). Chosen from the outputs of a run without them (2026-12-04); what a run got is printed.
SGLANG_STOPS: dict[str, dict[str, Any]] = {
    "early": {"stop_token_ids": [2041, 1475], "min_tokens": 20},
    "mix": {"stop_token_ids": [1387], "min_tokens": 20},
}


def routing_of(args: argparse.Namespace) -> Any:
    """The run's routing: every prompt short, ``max_tokens`` as asked, greedy; on real SGLang,
    the stop tokens that end its outputs early (``SGLANG_STOPS``)."""
    from producer.enqueue import Routing

    stops = SGLANG_STOPS.get(args.outputs, {}) if args.engine == "sglang" else {}
    return Routing(
        model="default",
        short_max_tokens=args.max_tokens,
        long_prompt_tokens=100_000,
        params={"temperature": 0.0, **stops},
    )


def enqueue_and_wait(client: redis.Redis, data: Path, args: argparse.Namespace, run: str) -> float:
    """Enqueue ``data`` as ``run`` and wait for every job to be done; the wall time."""
    from producer.enqueue import Enqueuer
    from tokenmill.ledger import Ledger

    t0 = time.monotonic()
    routing = routing_of(args)
    Enqueuer(Ledger(client, run), routing, max_queued=100_000).enqueue_file(data, PARTITION)
    counts = keys.RunKeys(run).counts()
    wait_for(
        lambda: int(client.hget(counts, f"done|{PARTITION}") or 0) == args.prompts,
        args.timeout,
        f"run {run} to finish",
    )
    return time.monotonic() - t0


def run_direct(
    work: Path, data: Path, args: argparse.Namespace, *, concurrency: int, shared: Server | None = None
) -> dict:
    """The direct asyncio client of bench/e2e.py at ``concurrency``, on ``shared`` or a fresh
    server."""
    from producer.readers import iter_records
    from producer.rows import normalize_row

    routing = routing_of(args)
    reqs = []
    for rec in iter_records(data):
        spec = routing.spec(normalize_row(rec.source, rec.data), PARTITION, rec.source)
        reqs.append({"id": spec.job_id, "queue": "short", "request": spec.request})
    reqs_path, out = work / "direct-requests.json", work / f"direct-{time.monotonic_ns()}.json"
    reqs_path.write_bytes(orjson.dumps(reqs))
    with Children() as children:
        server = shared or Server(children, work, args)
        server.begin()
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
    tuned = max(1, args.kv // (90 + sim_output(args)))
    named = {"low": args.low, "tuned": tuned, "high": args.high}
    out = []
    for name in (n.strip() for n in args.only.split(",")):
        if name == "admission":
            out.append((f"admission (threads {args.high}, no tuning)", "admission", args.high))
        elif name == "oracle":
            if "admission" not in [k for _, k, _ in out]:
                raise SystemExit("--only: oracle takes its window from an admission run named before it")
            out.append((f"admission told its window (oracle, threads {args.high})", "oracle", args.high))
        elif name == "against":
            if args.against is None:
                raise SystemExit("--only: against runs admission from the copy of the source --against names")
            out.append((f"admission [{args.against}] (threads {args.high})", "against", args.high))
        elif name == "unpaced":
            out.append((f"admission, not paced (threads {args.high})", "unpaced", args.high))
        elif m := re.fullmatch(r"placebo(\d+)", name):
            # fixed N again, judged as admission is: what the verdict says of a fixed setting
            out.append((f"placebo (fixed {m[1]} again)", "fixed", int(m[1])))
        elif m := re.fullmatch(r"paced(\d+)", name):
            out.append((f"admission, paced {m[1]} at once (threads {args.high})", name, args.high))
        elif name in named:
            out.append((f"fixed {named[name]} ({name})", "fixed", named[name]))
        elif m := re.fullmatch(r"(fixed|direct)(\d+)", name):
            kind = m[1]
            out.append((f"{kind} {m[2]}" + (" (direct client)" if kind == "direct" else ""), kind, int(m[2])))
        else:
            known = "low, tuned, high, admission, against, oracle, unpaced, pacedN, fixedN, placeboN, directN"
            raise SystemExit(f"--only: unknown variant {name!r} ({known})")
    return out


# The matrix of issue 26: a base cell (the workload: short prompts, outputs that run to
# max_tokens, a small KV pool, a cold start, one worker) and one cell per other value of each
# axis, the rest as in the base: a fractional design (each axis varied from the base alone), not
# the 48 cells of the full product; and a steady-state cell (issue 55), the base five times over.
BASE_CELL: dict[str, Any] = {
    "prompt_style": "short",
    "outputs": "max",
    "pool": "small",
    "warm": False,
    "workers": 1,
}
CELLS: dict[str, dict[str, Any]] = {
    "base": {},
    "long-prompts": {"prompt_style": "long"},
    "early-stop": {"outputs": "early"},
    "mixed-outputs": {"outputs": "mix"},
    "roomy-kv": {"pool": "roomy"},
    "warm": {"warm": True},
    "workers-2": {"workers": 2},
    "steady": {"prompts": 480},  # issue 55: the cold start amortised over five waves
}
POOLS = {"small": 4000, "roomy": 20000}
# The sim's step in the matrix: real SGLang's on these CPUs at half the time. Its decode steps
# took 7 ms + 0.69 ms a running request (a least-squares fit over the base cell's 13,940 steps,
# 2026-12-06); a sim whose steps barely grow with the batch (a GPU's: 0.05) spreads paced starts
# evenly where real SGLang, whose lifetimes stretch with the batch, does not, and it hid that
# admission's pacing margin keeps the real server from retracting.
SIM_STEPS = (3.5, 0.345)
SIM_STEPS_ALONE = (8.0, 0.05)  # outside the matrix: a GPU's flat step
MATRIX_VARIANTS = "fixed8,fixed16,fixed32,fixed64,admission"
TARGET = 1.05  # admission's wall over the fastest fixed setting's, at most (issue 55)


def cell_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """``args`` with the axes of cell ``name``."""
    axes = {**BASE_CELL, **CELLS[name]}
    pool = axes.pop("pool")
    return argparse.Namespace(**{**vars(args), **axes, "kv": POOLS[pool], "cell": name})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("sim", "sglang"), default="sim")
    ap.add_argument(
        "--split",
        action="store_true",
        help="sglang: only the scheduler keeps its core; its front end and detokenizer share the "
        "clients' core (a diagnostic: the front end then competes with the client and sets the pace)",
    )
    ap.add_argument(
        "--server-per-run",
        action="store_true",
        help="sglang: a fresh server for every run (the default shares one per cell, flushed between runs)",
    )
    ap.add_argument("--prompts", type=int, default=None, help="default 400 (sim), 96 (sglang and --matrix)")
    ap.add_argument(
        "--kv", type=int, default=None, help="--max-total-tokens (default 24000 sim, 4000 sglang)"
    )
    ap.add_argument("--prompt-style", choices=("long", "short"), default="long")
    ap.add_argument(
        "--outputs", choices=("max", "early", "mix"), default="max",
        help="outputs that run to max_tokens, stop early, or half and half (the sim: unless "
        "--mean-output; real SGLang: by stop tokens, see SGLANG_STOPS)",
    )  # fmt: skip
    ap.add_argument("--mean-output", type=int, default=None, help="the sim's mean output length (300)")
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="default 1024 (sim), 200 (sglang and --matrix)"
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help=f"the sim's step: default {SIM_STEPS_ALONE[0]} ({SIM_STEPS[0]} in --matrix)",
    )
    ap.add_argument(
        "--step-ms-per-req",
        type=float,
        default=None,
        help=f"... and per request: {SIM_STEPS_ALONE[1]} ({SIM_STEPS[1]} in --matrix)",
    )
    ap.add_argument("--low", type=int, default=8)
    ap.add_argument("--high", type=int, default=256, help="the admission variant's threads (a worker's)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--warm", action="store_true", help="run the dataset once under another run id first")
    ap.add_argument(
        "--cache-report", action=argparse.BooleanOptionalAction, default=True,
        help="sglang: --enable-cache-report (usage states the prompt tokens served from the prefix cache)",
    )  # fmt: skip
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--only", default=None, help="variants, comma-separated (see above)")
    ap.add_argument("--trace", action="store_true", help="print a 0.5 s timeline of each variant")
    ap.add_argument(
        "--against", type=Path, default=None, metavar="DIR",
        help="another copy of the source (a git worktree): variant 'against' is admission run from it",
    )  # fmt: skip
    ap.add_argument(
        "--matrix", default=None, metavar="CELLS",
        help=f"cells, comma-separated or 'all' ({', '.join(CELLS)}); --repeat defaults to 3 there",
    )  # fmt: skip
    ap.add_argument("--lock", default=None, help="a file to flock around each variant's run (shared CPU)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (servers' logs)")
    ap.add_argument("--json-out", default=None, help="append each run's result as a JSON line here")
    args = ap.parse_args()
    exit_on_sigterm()
    real = args.engine == "sglang"
    matrix = args.matrix is not None
    args.prompts = args.prompts or (96 if real or matrix else 400)
    args.kv = args.kv or (4000 if real else 24000)
    args.max_tokens = args.max_tokens or (200 if real or matrix else 1024)
    step, per_req = SIM_STEPS if matrix else SIM_STEPS_ALONE
    args.step_ms = step if args.step_ms is None else args.step_ms
    args.step_ms_per_req = per_req if args.step_ms_per_req is None else args.step_ms_per_req
    if matrix:
        args.high = 64 if "--high" not in sys.argv else args.high  # the worker: concurrency 64
        args.repeat = args.repeat if "--repeat" in sys.argv else 3
    elif args.mean_output is None and args.outputs == "max" and args.prompt_style == "long":
        args.mean_output = 300  # the default workload: outputs of 75-525 tokens
    args.only = args.only or (MATRIX_VARIANTS if matrix or real else "low,tuned,high,admission")
    print(f"machine: {machine()}")
    if real:
        print(f"cores: {pin_clients()}")
        if args.split:
            print("       only SGLang's scheduler keeps its core; its front end and detokenizer share ours")
    print(f"busy cores before the start: {wait_quiet():.2f} (waits up to 2 min for an idle machine)")
    load = MachineLoad()
    names = (list(CELLS) if args.matrix == "all" else args.matrix.split(",")) if matrix else [None]
    cells = [cell_args(args, n) if n else args for n in names]
    with workdir(args.keep, prefix="tm-bench-adm-") as work:
        tables = [measure(work, cell, args.lock, args.json_out) for cell in cells]
    print(load.line())
    for cell, results in zip(cells, tables, strict=True):
        report(cell, results)


def measure(
    work: Path, args: argparse.Namespace, lock: str | None, json_out: str | None
) -> dict[str, list[dict]]:
    """Each variant ``args.repeat`` times, in alternating rounds; the results by variant. Each
    round starts one variant further along (round r runs variant r first): this machine drifts
    within a round, so a variant always run last would pay for the drift.

    Real SGLang is shared by the cell's runs unless ``--server-per-run`` (started once, warmed
    up, flushed before each run, the lock held for the cell): a round then takes a fraction of
    the time, so its variants run closer together in time, where this host's speed drifts
    less."""
    chosen = variants(args)
    results: dict[str, list[dict]] = {label: [] for label, _, _ in chosen}
    data = make_dataset(work / f"{PARTITION}-{time.monotonic_ns()}.jsonl", args.prompts, args.prompt_style)
    cell = getattr(args, "cell", None)
    share = args.engine == "sglang" and not args.server_per_run
    with contextlib.ExitStack() as stack:
        shared = None
        if share:
            stack.enter_context(heavy(lock))
            shared = Server(stack.enter_context(Children()), work, args)
            shared.warm_up()
        # the last admission run's highest window and lifetime, for oracle (round 0 runs in the
        # order of --only, where admission comes first)
        learned: tuple[int, float] | None = None
        for round_no in range(args.repeat):
            turn = round_no % len(chosen)
            for label, kind, n in chosen[turn:] + chosen[:turn]:
                with contextlib.nullcontext() if share else heavy(lock):
                    if kind == "direct":
                        r = run_direct(work, data, args, concurrency=n, shared=shared)
                    else:
                        group = int(kind[5:]) if kind.startswith("paced") else None
                        r = run_tokenmill(
                            work, data, args, admission=kind != "fixed", threads=n,
                            paced=kind != "unpaced", group=group, shared=shared,
                            oracle=learned if kind == "oracle" else None,
                            source=args.against if kind == "against" else ROOT,
                        )  # fmt: skip
                        if kind == "admission" and "window_max" in r:
                            learned = (r["window_max"], r["life_ms"])
                results[label].append(r)
                shown = {k: v for k, v in r.items() if k != "steps"}  # steps: in --json-out
                print(f"  {cell or ''} {label}: {shown}", flush=True)
                if json_out:
                    with open(json_out, "a") as fh:
                        fh.write(json.dumps({"cell": cell, "round": round_no, "variant": label, **r}) + "\n")
    return results


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    cell = getattr(args, "cell", None)
    outputs = args.outputs if args.mean_output is None else f"mean {args.mean_output}"
    print(
        f"\nadmission benchmark ({args.engine}{', cell ' + cell if cell else ''}): {args.prompts} "
        f"{args.prompt_style} prompts, outputs {outputs}, "
        f"KV {args.kv} tokens, max_tokens {args.max_tokens}, {args.workers} worker(s), "
        f"{'warm' if args.warm else 'cold'} start, median of {args.repeat}"
    )
    med = {n: statistics.median(r["wall_s"] for r in rs) for n, rs in results.items()}
    retr = {n: statistics.median(r["retractions"] for r in rs) for n, rs in results.items()}
    fixed = {n: v for n, v in med.items() if n.startswith("fixed")}
    best = min(fixed, key=lambda n: fixed[n]) if fixed else None
    # SGLang's forward passes (its log's decode steps and prefill batches): the work the variant
    # made the server do, which the host's speed, unlike the wall time, does not move
    passes = {}
    if all("passes" in r for rs in results.values() for r in rs):
        passes = {n: statistics.median(r["passes"] for r in rs) for n, rs in results.items()}
    rows = []
    for name, rs in results.items():
        running = statistics.median(r.get("decode_running") or r["mean_running"] for r in rs)
        ratio = med[name] / fixed[best] if best else float("nan")
        walls = ", ".join(f"{r['wall_s']:.1f}" for r in rs)
        retractions = ", ".join(str(r["retractions"]) for r in rs)
        row = [name, f"{med[name]:.1f} ({walls})", f"{retr[name]:g} ({retractions})", f"{running:.1f}"]
        if passes:
            row.append(f"{passes[name]:g} ({', '.join(str(r['passes']) for r in rs)})")
        rows.append([*row, f"{ratio:.3f}"])
    outputs_seen = sorted(
        {(r["mean_output"], r["at_max"]) for rs in results.values() for r in rs if "at_max" in r}
    )
    if outputs_seen:  # every variant's, and every round's: the same lengths unless they differ
        seen = "; ".join(f"mean {m:g} tokens, {n} at max_tokens" for m, n in outputs_seen)
        print(f"outputs of {args.prompts}: {seen}")
    heads = ["variant", "wall s (rounds)", "retractions (rounds)", "mean running"]
    print(table([*heads, *(["server passes (rounds)"] if passes else []), "vs fastest fixed"], rows))
    for judged in (n for n in results if best and n.startswith("placebo (")):
        # a fixed setting judged as admission is: how far this host's noise alone moves the verdict
        print(verdicts(judged, best, med, retr) + "; " + paired(judged, best, results))
    adm = next((n for n in results if n.startswith("admission (")), None)
    if adm and best:
        print(verdicts(adm, best, med, retr))
        print(paired(adm, best, results))
        if passes:
            # the same verdicts with the server's passes in place of the wall time: what the
            # variant made the server do, on a host whose speed drifts between runs (a pass of a
            # bigger batch costs more: fewer, bigger passes flatter admission's larger windows)
            by = {n: float(v) for n, v in passes.items()}
            print("by the server's passes: " + verdicts(adm, min(fixed, key=lambda n: by[n]), by, retr))
        runs = [(n, r) for n, rs in results.items() for r in rs]
        if all(r.get("steps") for _, r in runs):
            # the wall at the runs' common host speed: each run's wall over how slowly the host ran
            # its decode steps, batch size by batch size (host_speeds)
            at: dict[str, list[float]] = {n: [] for n in results}
            for (n, r), speed in zip(runs, host_speeds([r["steps"] for _, r in runs]), strict=True):
                at[n].append(r["wall_s"] / speed)
            even = {n: statistics.median(v) for n, v in at.items()}
            spread = ", ".join(f"{w:.1f}" for w in at[adm])
            print(
                "at the runs' common host speed: "
                + verdicts(adm, min(fixed, key=lambda n: even[n]), even, retr)
                + f" (admission {spread} s; fixed "
                + "; ".join(f"{n.split()[1]} {', '.join(f'{w:.1f}' for w in at[n])}" for n in fixed)
                + ")"
            )


def paired(judged: str, best: str, results: dict[str, list[dict]]) -> str:
    """The ratio within each round (its variants ran within a minute or two of each other: it
    leaves out the host's drift between rounds, not its jitter within one), and their median."""
    pairs = [a["wall_s"] / b["wall_s"] for a, b in zip(results[judged], results[best], strict=True)]
    return (
        f"paired by round: {judged.split(' (')[0]} / {best} in the same round = median "
        f"{statistics.median(pairs):.3f} ({', '.join(f'{p:.2f}' for p in pairs)})"
    )


def verdicts(judged: str, best: str, med: dict[str, float], retr: dict[str, float]) -> str:
    """Issue 55's verdict (issue 26's was 10%): within 5% of the fastest fixed setting with no more
    retractions than it; and within 5% of the fastest fixed setting that did not retract."""
    fast = med[judged] <= TARGET * med[best] and retr[judged] <= retr[best]
    line = (
        f"{judged.split(' (')[0]} / fastest fixed ({best}) = {med[judged] / med[best]:.3f}, "
        f"retractions {retr[judged]:g} vs {retr[best]:g}: {verdict(fast)}"
    )
    clean = [n for n in med if n.startswith("fixed") and retr[n] == 0]
    if clean:
        ref = min(clean, key=lambda n: med[n])
        ok = med[judged] <= TARGET * med[ref]
        line += f"; / fastest zero-retraction fixed ({ref}) = {med[judged] / med[ref]:.3f}: {verdict(ok)}"
    return line


if __name__ == "__main__":
    main()
