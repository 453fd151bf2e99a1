"""``tokenmill api``'s overhead (issue 57): an OpenAI Batch input file run through the API (upload,
create, wait, download) against ``tokenmill enqueue`` + ``tokenmill export`` of the same file.

One private redis-server (AOF on), flushed after each variant, and one result store. Variants,
alternating in each round (A B A B ...), each on a fresh run:

- ``cli``: ``tokenmill enqueue FILE --run R --partition batch`` (a subprocess: interpreter start,
  read, validate, enqueue), then once every job is done ``tokenmill export --run R --out DIR
  --format openai-batch --include-truncated`` (what the API's finalization writes);
- ``api``: through the ``openai`` SDK against one long-lived ``tokenmill api`` process:
  ``files.create`` (upload), ``batches.create`` until ``in_progress`` (validation, then enqueue),
  once every job is done until ``completed`` (finalization: the same export's lines, written
  straight into the output and error files), ``files.content`` of the output file streamed to
  disk (download).

Generation is not measured: no worker and no server run. In both variants, once the file is
enqueued, every job is finished the same way, untimed: claimed and committed through the
ledger's own transitions with the sim's deterministic output (``tests/finishing.py``, 2
processes, ``--output-tokens`` mean), then the broker messages and backlog ids workers would have
consumed are dropped. What is timed is tokenmill's own work on either side of it. The API's
background loop looks at active batches every ``TOKENMILL_API_POLL_S`` (0.05 s here) and the SDK
polls every 0.05 s, so up to ~0.1 s of a phase is waiting.

Memory: the API process's peak RSS (VmHWM) after each phase of one batch, a fresh process per
file size that first ran a 10-line batch (the export's modules, ~48 MB, are imported the first
time a batch ends), beside what the custom_id set validation keeps (one entry a line) takes.

    .venv/bin/python bench/api.py                            # 100,000 lines, 3 rounds: ~7 min
    .venv/bin/python bench/api.py --lines 20000 --rounds 2   # quicker
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis
from _common import (
    Child,
    Children,
    MachineLoad,
    exit_on_sigterm,
    http_status,
    machine,
    median,
    proc_rss_peak_mb,
    run_measured,
    table,
    verdict,
    wait_for,
    wait_quiet,
    workdir,
)
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ is not an installed package
from tests.finishing import all_job_ids, finish_jobs
from tokenmill import keys
from tokenmill.local_redis import free_port

TARGET = 1.2  # api / cli, total
PARTITION = "batch"  # the API's one partition; the CLI is given the same
MAX_TOKENS = 64
POLL_S = 0.05
WORDS = "explain compare summarize the a of queue token cache server batch prompt model why how".split()
FLAT_SLACK_MB = 20  # what the allocator and lazy imports move a peak by between runs
PHASES = ("upload", "validate+enqueue", "finalize/export", "download")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=100_000, help="lines of the Batch input file")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each cli then api (0: memory only)")
    p.add_argument("--output-tokens", type=int, default=8, help="mean output tokens of the finished jobs")
    p.add_argument(
        "--memory-sizes", default="", help="file sizes of the memory runs, e.g. 20000,100000 (default: N/5,N)"
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p.parse_args()


def write_input(path: Path, n: int, seed: int = 57) -> int:
    """An OpenAI Batch input file of ``n`` short chat requests; returns its size in bytes."""
    rng = random.Random(seed)
    with open(path, "wb") as fh:
        for i in range(n):
            text = f"#{i}: " + " ".join(rng.choice(WORDS) for _ in range(8))
            body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS}
            line = {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            fh.write(orjson.dumps(line) + b"\n")
    return path.stat().st_size


# --- finishing the jobs (untimed, the same in both variants) ------------------------------------------


def _finish_slice(url: str, run: str, ids: list[str], tokens: int) -> int:
    return finish_jobs(redis.Redis.from_url(url), run, ids, mean_output_tokens=tokens, reasoning=False)


def finish(url: str, run: str, tokens: int) -> tuple[int, float]:
    """Every job of ``run`` done, in two processes; then what workers would have consumed dropped.
    Returns (jobs, seconds)."""
    client = redis.Redis.from_url(url)
    ids = all_job_ids(client, run)
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        slices = [(url, run, ids[0::2], tokens), (url, run, ids[1::2], tokens)]
        done = sum(pool.starmap(_finish_slice, slices))
    k = keys.RunKeys(run)
    client.delete(*(keys.broker_queue(q) for q in keys.QUEUES), *(k.backlog(q) for q in keys.QUEUES))
    return done, time.perf_counter() - start


def lines_in(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)


# --- the variants ----------------------------------------------------------------------------------


@dataclass
class Stack:
    where: Path
    redis_url: str
    env: dict[str, str]
    tokens: int

    def tm(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "tokenmill.cli", *args]

    def flush(self) -> None:
        redis.Redis.from_url(self.redis_url).flushall()


def run_cli(stack: Stack, path: Path, run: str, n: int) -> tuple[dict[str, float], float]:
    """``tokenmill enqueue`` then ``tokenmill export``: the phases' seconds and the finishing's."""
    enq = run_measured(stack.tm("enqueue", str(path), "--run", run, "--partition", PARTITION),
                       stack.where / f"enqueue-{run}.log", stack.env)  # fmt: skip
    assert enq.returncode == 0, enq.output
    done, finish_s = finish(stack.redis_url, run, stack.tokens)
    assert done == n, f"{done} of {n} jobs of {run} finished"
    out = stack.where / f"out-{run}"
    export = ("export", "--run", run, "--out", str(out), "--format", "openai-batch", "--include-truncated")
    exp = run_measured(stack.tm(*export), stack.where / f"export-{run}.log", stack.env)
    assert exp.returncode == 0, exp.output
    assert lines_in(out / f"{PARTITION}.jsonl") == n
    phases = {"upload": 0.0, "validate+enqueue": enq.wall_s, "finalize/export": exp.wall_s, "download": 0.0}
    return phases, finish_s


def wait_batch(client: OpenAI, batch_id: str, status: str, timeout_s: float = 1800) -> None:
    def reached() -> bool:
        b = client.batches.retrieve(batch_id)
        assert b.status in ("validating", "in_progress", "finalizing", status), (b.status, b.errors)
        return b.status == status

    wait_for(reached, timeout_s, f"batch {batch_id} {status}", POLL_S)


def run_api(
    stack: Stack, client: OpenAI, path: Path, n: int, peaks: dict[str, float] | None = None, pid: int = 0
) -> tuple[dict[str, float], float]:
    """Upload, create, wait, download through the SDK: the phases' seconds and the finishing's;
    with ``peaks``, the peak RSS of process ``pid`` (the API) after each phase goes there."""

    def peak(phase: str) -> None:
        if peaks is not None:
            peaks[phase] = proc_rss_peak_mb(pid)

    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        f = client.files.create(file=(path.name, fh), purpose="batch")
    t1 = time.perf_counter()
    peak("upload")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_batch(client, batch.id, "in_progress")
    t2 = time.perf_counter()
    peak("validate+enqueue")
    done, finish_s = finish(stack.redis_url, batch.id, stack.tokens)
    assert done == n, f"{done} of {n} jobs of {batch.id} finished"
    t3 = time.perf_counter()
    wait_batch(client, batch.id, "completed")
    t4 = time.perf_counter()
    peak("finalize/export")
    out_id = client.batches.retrieve(batch.id).output_file_id
    assert out_id is not None
    target = stack.where / f"out-{batch.id}.jsonl"
    with client.files.with_streaming_response.content(out_id) as resp:
        resp.stream_to_file(target)
    t5 = time.perf_counter()
    peak("download")
    assert lines_in(target) == n
    target.unlink()
    phases = {"upload": t1 - t0, "validate+enqueue": t2 - t1, "finalize/export": t4 - t3, "download": t5 - t4}
    return phases, finish_s


def start_api(children: Children, stack: Stack, name: str) -> tuple[Child, OpenAI]:
    """A ``tokenmill api`` process, listening; and an SDK client of it."""
    port = free_port()
    api = children.spawn(name, stack.tm("api", "--port", str(port)), stack.where / f"{name}.log", stack.env)
    url = f"http://127.0.0.1:{port}/v1"
    wait_for(lambda: http_status(f"{url}/files") == 200 or not api.alive(), 60, "tokenmill api listening")
    assert api.alive(), api.output()
    return api, OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def custom_id_set_mb(n: int) -> float:
    """What a set of ``n`` custom_ids of the input's shape takes (validation keeps one a line)."""
    tracemalloc.start()
    seen = {f"req-{i}" for i in range(n)}
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del seen
    return size / 2**20


# --- the runs --------------------------------------------------------------------------------------


def timed_rounds(args: argparse.Namespace, children: Children, stack: Stack) -> list[str]:
    path = stack.where / "input.jsonl"
    size = write_input(path, args.lines)
    print(f"input: {args.lines:,} lines, {size / 2**20:.1f} MB", flush=True)
    _, client = start_api(children, stack, "api")
    results: dict[str, list[dict[str, float]]] = {"cli": [], "api": []}
    finishing: list[float] = []
    for r in range(1, args.rounds + 1):
        cli, f_cli = run_cli(stack, path, f"cli-{r}", args.lines)
        stack.flush()
        api, f_api = run_api(stack, client, path, args.lines)
        stack.flush()
        results["cli"].append(cli)
        results["api"].append(api)
        finishing += [f_cli, f_api]
        ratio = sum(api.values()) / sum(cli.values())
        print(f"round {r}: cli {sum(cli.values()):.2f} s, api {sum(api.values()):.2f} s, api/cli {ratio:.3f} "
              f"(finishing, untimed: {f_cli:.1f} s, {f_api:.1f} s)", flush=True)  # fmt: skip
    ratios = [sum(a.values()) / sum(c.values()) for a, c in zip(results["api"], results["cli"], strict=True)]
    rows = []
    for phase in PHASES:
        c = median([x[phase] for x in results["cli"]])
        a = median([x[phase] for x in results["api"]])
        by_round = ", ".join(f"{x[phase]:.2f}" for x in results["api"])
        rows.append([phase, f"{c:.2f}", f"{a:.2f}", by_round])
    c_total = median([sum(x.values()) for x in results["cli"]])
    a_total = median([sum(x.values()) for x in results["api"]])
    by_round = ", ".join(f"{sum(x.values()):.2f}" for x in results["api"])
    rows.append(["total", f"{c_total:.2f}", f"{a_total:.2f}", by_round])
    print(f"\n## API overhead — {args.lines:,} lines, {args.rounds} rounds ({machine()})\n")
    print(table(["phase (wall s, median)", "cli", "api", "api by round"], rows))
    ok = median(ratios) <= TARGET
    shown = ", ".join(f"{x:.3f}" for x in ratios)
    print(f"\napi / cli, total: **{median(ratios):.3f}** (rounds {shown}); target <= {TARGET}: {verdict(ok)}")
    print(f"finishing the jobs (untimed, both variants alike): median {median(finishing):.1f} s")
    return [] if ok else [f"api / cli {median(ratios):.3f} (target <= {TARGET})"]


def memory_runs(args: argparse.Namespace, children: Children, stack: Stack) -> list[str]:
    """A fresh API process per file size: a 10-line batch first (what every batch imports the
    first time, the export's modules ~48 MB, is then in), then one of the size; the peak RSS
    after each of the second's phases."""
    sizes = [int(x) for x in args.memory_sizes.split(",") if x] or [args.lines // 5, args.lines]
    rows = []
    # (peak over the one after 10 lines, custom_id set) by size: whether the export's import shows
    # in RSS varies from process to process (48 MB or none), so only what comes after it is compared
    ends: list[tuple[float, float]] = []
    warm = stack.where / "warm.jsonl"
    write_input(warm, 10)
    for n in sizes:
        path = stack.where / f"input-{n}.jsonl"
        size = write_input(path, n)
        api, client = start_api(children, stack, f"api-mem-{n}")
        idle = vm_rss_mb(api.pid)
        run_api(stack, client, warm, 10)
        warmed = proc_rss_peak_mb(api.pid)
        peaks: dict[str, float] = {}
        run_api(stack, client, path, n, peaks, api.pid)
        api.stop()
        stack.flush()
        path.unlink()
        ids = custom_id_set_mb(n)
        ends.append((peaks["download"] - warmed, ids))
        by_phase = [f"{peaks[p]:.0f}" for p in PHASES]
        rows.append(
            [f"{n:,}", f"{size / 2**20:.1f}", f"{idle:.0f}", f"{warmed:.0f}", *by_phase, f"{ids:.1f}"]
        )
        print(f"memory run of {n:,} lines: peak {peaks['download']:.0f} MB", flush=True)
    print(f"\n## API process memory ({machine()})\n")
    after = [f"peak after {p}" for p in PHASES]
    print(table(["lines", "file MB", "RSS idle MB", "after 10 lines", *after, "custom_id set MB"], rows))
    grew, ids_grew = ends[-1][0] - ends[0][0], ends[-1][1] - ends[0][1]
    flat = grew <= ids_grew + FLAT_SLACK_MB
    print(f"\npeak RSS over the one after 10 lines, from {sizes[0]:,} to {sizes[-1]:,} lines: {grew:+.0f} MB "
          f"(the custom_id set: {ids_grew:+.1f} MB); flat (within the set + {FLAT_SLACK_MB} MB): "
          f"{verdict(flat)}")  # fmt: skip
    return [] if flat else [f"the API's peak RSS grew {grew:.0f} MB with the file"]


def main() -> int:
    args = parse_args()
    exit_on_sigterm()
    print(f"waiting for a quiet machine... (busy cores: {wait_quiet(30.0):.2f})", flush=True)
    load = MachineLoad()
    started = time.strftime("%Y-%m-%d %H:%M")
    with workdir(keep=args.keep, prefix="tokenmill-api-") as where, Children() as children:
        server = children.redis(where / "redis")
        env = {
            "TOKENMILL_REDIS_URL": server.url,
            "TOKENMILL_RESULTS_URL": str(where / "store"),
            "TOKENMILL_API_POLL_S": str(POLL_S),
        }
        stack = Stack(where, server.url, env, args.output_tokens)
        problems = timed_rounds(args, children, stack) if args.rounds else []
        problems += memory_runs(args, children, stack)
    print(f"\nstarted {started}; {load.line()}")
    print("problems:" if problems else "no problem: every target met")
    for p in problems:
        print(f"- {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
