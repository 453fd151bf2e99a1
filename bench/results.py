"""Results: what Redis holds per job queued, done and sealed; how fast done results are sealed and
exported back from shards, and the export's memory; shard bytes against the text they hold.

One private redis-server (AOF on, as tokenmill runs it: ``hash-max-listpack-value 8192``) and
the real CLI for every step: ``tokenmill enqueue``, ``tokenmill seal --once --all``, ``tokenmill
export``. Between enqueue and seal the jobs are finished through the ledger's own claim and
commit with the sim's deterministic output for each request, in two processes
(``tests/finishing.py``): the ledger state a worker's commit leaves, without the HTTP streaming
that ``bench/e2e.py`` measures; the broker messages and backlog ids workers would have consumed
are then dropped. ``--finish workers`` has a real worker stream them from the sim instead
(much slower). Redis bytes are ``INFO memory`` ``used_memory`` deltas divided
by jobs.

Prompts are ~1.2 KB of text, outputs the sim's with ``--sim-mean-output-tokens 250`` (~1.2 KB of
reasoning and content): the sizes of the issue's measurement. The export before sealing (every
row from Redis) and after (every row from shards) must be byte-identical (checked).

    .venv/bin/python bench/results.py                          # 100,000 jobs
    .venv/bin/python bench/results.py --jobs 10000             # quicker
    .venv/bin/python bench/results.py --rss-rows 1000000       # + a 1M-row run: export RSS
    .venv/bin/python bench/results.py --jobs 10000 --finish workers
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import redis
from _common import (
    Children,
    MachineLoad,
    Measured,
    exit_on_sigterm,
    machine,
    run_measured,
    start_sim,
    start_worker,
    table,
    verdict,
    wait_for,
    wait_quiet,
    workdir,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ is not an installed package
from server_mgr.sim.textgen import VOCAB
from tests.finishing import all_job_ids, finish_jobs
from tokenmill import keys

MEAN_OUTPUT_TOKENS = 250
MAX_TOKENS = 1024
PROMPT_CHARS = 1200
PARTITIONS = ("A", "B")  # 70% / 30% of the rows
TARGET_SEALED = 300
TARGET_QUEUED_RATIO = 1.5
TARGET_RSS_MB = 500
FINISHED_BY = {
    "ledger": "finish (claim + commit, 2 processes)",
    "workers": "finish (a worker, 64 threads, streaming from the sim)",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=100_000, help="jobs of the main run")
    p.add_argument("--rss-rows", type=int, default=0, help="also export a run of this many rows from shards")
    p.add_argument(
        "--chunk", type=int, default=100_000, help="jobs finished, then sealed, at a time (RSS run)"
    )
    p.add_argument(
        "--finish",
        choices=("ledger", "workers"),
        default="ledger",
        help="finish the main run's jobs through the ledger (fast) or with real workers and the sim",
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p.parse_args()


# --- the dataset ---------------------------------------------------------------------------------


def rows(n: int, seed: int) -> Iterator[dict[str, Any]]:
    """``n`` distinct rows of ~1.2 KB of text (words of the sim's vocabulary), half ``prompt``
    rows with an extra field, half ``messages`` rows with metadata."""
    rng = random.Random(seed)
    words = [w.strip() for w in VOCAB]
    for i in range(n):
        text = f"#{seed}-{i}:"
        while len(text.encode()) < PROMPT_CHARS:
            text += " " + rng.choice(words)
        if i % 2:
            yield {"prompt": text, "source": "synthetic"}
        else:
            yield {"messages": [{"role": "user", "content": text}], "metadata": {"i": i}}


def write_dataset(where: Path, n: int, seed: int) -> tuple[list[Path], int, int]:
    """The partitions' JSONL files; returns them, the prompt JSON bytes (``messages`` as stored)
    and the prompt text bytes."""
    paths = [where / f"{p}-{seed}.jsonl" for p in PARTITIONS]
    handles = [open(p, "wb") for p in paths]
    json_bytes = text_bytes = 0
    try:
        for i, row in enumerate(rows(n, seed)):
            handles[0 if i % 10 < 7 else 1].write(orjson.dumps(row) + b"\n")
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            json_bytes += len(orjson.dumps(messages))
            text_bytes += sum(len(m["content"].encode()) for m in messages)
    finally:
        for h in handles:
            h.close()
    return paths, json_bytes, text_bytes


# --- steps ---------------------------------------------------------------------------------------


def tm(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", *args]


def used(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def enqueue(where: Path, env: dict[str, str], run: str, paths: list[Path], *more: str) -> None:
    flags = ["--short-max-tokens", str(MAX_TOKENS), "--long-max-tokens", str(MAX_TOKENS), *more]
    for path in paths:
        m = run_measured(tm("enqueue", str(path), "--run", run, *flags), where / f"enqueue-{run}.log", env)
        assert m.returncode == 0, m.output


def _finish_slice(url: str, run: str, ids: list[str]) -> int:
    return finish_jobs(redis.Redis.from_url(url), run, ids, mean_output_tokens=MEAN_OUTPUT_TOKENS)


def finish(url: str, client: redis.Redis, run: str, ids: list[str] | None = None) -> tuple[int, float]:
    """Finish ``ids`` (default: every job) in two processes; then drop what workers would have
    consumed (broker messages, backlog ids). Returns (jobs, seconds)."""
    ids = all_job_ids(client, run) if ids is None else ids
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        done = sum(pool.starmap(_finish_slice, [(url, run, ids[0::2]), (url, run, ids[1::2])]))
    k = keys.RunKeys(run)
    client.delete(*(keys.broker_queue(q) for q in keys.QUEUES), *(k.backlog(q) for q in keys.QUEUES))
    return done, time.perf_counter() - start


def finish_with_workers(
    children: Children, where: Path, url: str, client: redis.Redis, run: str
) -> tuple[int, float]:
    """Finish every job of ``run`` with a real worker streaming from the sim (1 ms a step)."""
    knobs = ["--reasoning-parser", "qwen3", "--sim-mean-output-tokens", str(MEAN_OUTPUT_TOKENS),
             "--sim-step-ms", "1", "--sim-prefill-tokens-per-ms", "100000"]  # fmt: skip
    _, sim_url = start_sim(children, where, knobs)
    start = time.perf_counter()
    start_worker(children, where, "short", 64, {"TOKENMILL_REDIS_URL": url, "TOKENMILL_SERVER_URL": sim_url})
    k = keys.RunKeys(run)

    def finished() -> int:
        counts = {f.decode(): int(v) for f, v in client.hgetall(k.counts()).items()}
        left = sum(v for f, v in counts.items() if f.startswith(("queued|", "running|")))
        return 0 if left else sum(v for f, v in counts.items() if f.startswith("done|"))

    done = wait_for(finished, 7200, f"the jobs of run {run} to finish", 1.0)
    return done, time.perf_counter() - start


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.jsonl"))}


def text_in_export(folder: Path) -> tuple[int, int]:
    """(rows, bytes of prompt and completion text: message contents and reasoning)."""
    n = total = 0
    for path in folder.glob("*.jsonl"):
        with open(path, "rb") as fh:
            for line in fh:
                row = orjson.loads(line)
                n += 1
                for m in row["messages"]:
                    total += len(m["content"].encode()) + len((m.get("reasoning_content") or "").encode())
    return n, total


def tree_bytes(folder: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in folder.rglob(pattern) if p.is_file())


def step_row(label: str, n: int, m: Measured) -> list[str]:
    return [
        label,
        f"{n:,}",
        f"{m.wall_s:.1f}",
        f"{n / m.wall_s:,.0f}",
        f"{m.cpu_s:.1f}",
        f"{m.max_rss_mb:.0f}",
    ]


def bytes_row(label: str, total: int, n: int, text: int) -> list[str]:
    return [label, f"{total:,}", f"{total / n:,.0f}", f"{total / text:.2f}"]


# --- the main run --------------------------------------------------------------------------------


def main_run(args: argparse.Namespace, where: Path, children: Children) -> list[str]:
    """The measurements of the main run; returns the problems found."""
    server = children.redis(where / "redis")
    client = redis.Redis.from_url(server.url)
    store = where / "store"
    env = {"TOKENMILL_REDIS_URL": server.url, "TOKENMILL_RESULTS_URL": str(store)}
    paths, prompt_json, prompt_text = write_dataset(where, args.jobs, seed=1)
    n = args.jobs
    problems: list[str] = []

    # queued: with Redis's default compact-hash limit, with tokenmill's, and with fewer messages
    # published (the broker holds at most max_queued, 20,000 by default; the rest wait as ids)
    client.config_set("hash-max-listpack-value", 64)
    base = used(client)
    enqueue(where, env, "q64", paths)
    queued_64 = (used(client) - base) / n
    client.flushall()
    client.config_set("hash-max-listpack-value", 8192)
    base = used(client)
    enqueue(where, env, "q2k", paths, "--max-queued", "2000")
    queued_2k = (used(client) - base) / n
    client.flushall()
    base = used(client)
    enqueue(where, env, "r", paths)
    queued = (used(client) - base) / n

    if args.finish == "workers":
        done, finish_s = finish_with_workers(children, where, server.url, client, "r")
    else:
        done, finish_s = finish(server.url, client, "r")
    assert done == n, f"{done} of {n} jobs finished"
    done_bytes = (used(client) - base) / n

    before = run_measured(tm("export", "--run", "r", "--out", str(where / "before"), "--include-truncated"),
                          where / "export-before.log", env)  # fmt: skip
    assert before.returncode == 0, before.output
    sealed_run = run_measured(tm("seal", "--once", "--all", "--run", "r"), where / "seal.log", env)
    assert sealed_run.returncode == 0, sealed_run.output
    sealed = (used(client) - base) / n
    after = run_measured(tm("export", "--run", "r", "--out", str(where / "after"), "--include-truncated"),
                         where / "export-after.log", env)  # fmt: skip
    assert after.returncode == 0, after.output
    parquet = run_measured(tm("export", "--run", "r", "--out", str(where / "pq"), "--format", "parquet",
                              "--include-truncated"), where / "export-pq.log", env)  # fmt: skip
    assert parquet.returncode == 0, parquet.output
    identical = digest(where / "before") == digest(where / "after")
    rows_out, text = text_in_export(where / "after")
    shard_bytes = tree_bytes(store, "*.parquet") - tree_bytes(store / "r", "_specs/*.parquet")
    spec_bytes = tree_bytes(store / "r", "_specs/*.parquet")
    jsonl_bytes = tree_bytes(where / "after", "*.jsonl")
    shards = len(list(store.glob("r/*/*.parquet")))

    per_prompt = prompt_json / n
    print(f"\n## Results — {args.jobs:,} jobs ({machine()})\n")
    print(f"prompts: {prompt_text / n:,.0f} bytes of text a job ({per_prompt:,.0f} as the messages JSON); "
          f"outputs: the sim's, mean {MEAN_OUTPUT_TOKENS} tokens, max_tokens {MAX_TOKENS}")  # fmt: skip
    queued_ok = verdict(queued <= TARGET_QUEUED_RATIO * per_prompt)
    queued_2k_ok = verdict(queued_2k <= TARGET_QUEUED_RATIO * per_prompt)
    sealed_ok = verdict(sealed <= TARGET_SEALED)
    print(table(["Redis bytes per job", "bytes", "vs prompt JSON", "target"], [
        ["queued (Redis's default hash-max-listpack-value 64)", f"{queued_64:,.0f}",
         f"{queued_64 / per_prompt:.2f}x", ""],
        ["queued (hash-max-listpack-value 8192)", f"{queued:,.0f}", f"{queued / per_prompt:.2f}x",
         f"<= {TARGET_QUEUED_RATIO}x: {queued_ok}"],
        ["queued (8192, --max-queued 2000)", f"{queued_2k:,.0f}", f"{queued_2k / per_prompt:.2f}x",
         f"<= {TARGET_QUEUED_RATIO}x: {queued_2k_ok}"],
        ["done (result in Redis)", f"{done_bytes:,.0f}", "", ""],
        ["sealed (result in a shard)", f"{sealed:,.0f}", "", f"<= {TARGET_SEALED}: {sealed_ok}"],
    ]))  # fmt: skip
    print()
    print(table(["step", "rows", "wall s", "rows/s", "CPU s", "max RSS MB"], [
        [FINISHED_BY[args.finish], f"{n:,}", f"{finish_s:.1f}", f"{n / finish_s:,.0f}", "", ""],
        step_row("export JSONL from Redis (before sealing)", n, before),
        step_row("tokenmill seal --once --all", n, sealed_run),
        step_row("export JSONL from shards", n, after),
        step_row("export Parquet from shards", n, parquet),
    ]))  # fmt: skip
    print()
    print(table(["bytes", "total", "per job", "vs text"], [
        bytes_row("prompt + completion text (contents, reasoning)", text, n, text),
        bytes_row("JSONL export", jsonl_bytes, n, text),
        bytes_row(f"shards ({shards} files, Parquet + zstd)", shard_bytes, n, text),
        bytes_row("spec files (what repair regenerates from)", spec_bytes, n, text),
    ]))  # fmt: skip
    print(f"\nexport from shards == export from Redis, byte for byte: {identical} ({rows_out:,} rows)")
    if not identical or rows_out != n:
        problems.append(f"the export from shards differs from the one from Redis ({rows_out} rows)")
    if sealed > TARGET_SEALED:
        problems.append(f"{sealed:.0f} bytes per sealed job (target {TARGET_SEALED})")
    if queued > TARGET_QUEUED_RATIO * per_prompt:
        problems.append(
            f"a queued job holds {queued / per_prompt:.2f}x its prompt (target {TARGET_QUEUED_RATIO}x)"
        )
    return problems


# --- the RSS run ---------------------------------------------------------------------------------


def rss_run(args: argparse.Namespace, where: Path, children: Children) -> list[str]:
    """A run of ``--rss-rows`` jobs finished and sealed ``--chunk`` at a time (as a long run is);
    then its export from shards, with the export process's max RSS."""
    server = children.redis(where / "redis-big")
    client = redis.Redis.from_url(server.url)
    store = where / "store-big"
    env = {"TOKENMILL_REDIS_URL": server.url, "TOKENMILL_RESULTS_URL": str(store)}
    n = args.rss_rows
    paths, _, _ = write_dataset(where, n, seed=2)
    base = used(client)
    enqueue(where, env, "big", paths)
    ids = all_job_ids(client, "big")
    for p in paths:
        p.unlink()
    seal_s = finish_s = 0.0
    for start in range(0, n, args.chunk):
        finish_s += finish(server.url, client, "big", ids[start : start + args.chunk])[1]
        m = run_measured(tm("seal", "--once", "--all", "--run", "big"), where / "seal-big.log", env)
        assert m.returncode == 0, m.output
        seal_s += m.wall_s
        print(f"  {min(start + args.chunk, n):,} of {n:,} finished and sealed", flush=True)
    sealed = (used(client) - base) / n
    out = where / "out-big"
    m = run_measured(
        tm("export", "--run", "big", "--out", str(out), "--include-truncated"), where / "export-big.log", env
    )
    assert m.returncode == 0, m.output
    exported = 0
    for path in out.glob("*.jsonl"):
        with open(path, "rb") as fh:
            exported += sum(1 for _ in fh)
    print(f"\n## Export of {n:,} rows from shards\n")
    rss_ok = verdict(m.max_rss_mb < TARGET_RSS_MB)
    print(table(["step", "rows", "wall s", "rows/s", "CPU s", "max RSS MB", "target"], [
        ["finish (2 processes)", f"{n:,}", f"{finish_s:.0f}", f"{n / finish_s:,.0f}", "", "", ""],
        [f"tokenmill seal --once --all, every {args.chunk:,}", f"{n:,}", f"{seal_s:.0f}",
         f"{n / seal_s:,.0f}", "", "", ""],
        [*step_row("export JSONL from shards", exported, m), f"< {TARGET_RSS_MB} MB: {rss_ok}"],
    ]))  # fmt: skip
    print(f"\nRedis after sealing: {sealed:,.0f} bytes per job ({used(client) / 2**20:,.0f} MB in all)")
    problems = []
    if exported != n:
        problems.append(f"the 1M export has {exported} rows, not {n}")
    if m.max_rss_mb >= TARGET_RSS_MB:
        problems.append(f"export max RSS {m.max_rss_mb:.0f} MB (target < {TARGET_RSS_MB})")
    return problems


def main() -> int:
    args = parse_args()
    exit_on_sigterm()
    print(f"waiting for a quiet machine... (busy cores: {wait_quiet():.2f})", flush=True)
    load = MachineLoad()
    started = time.strftime("%Y-%m-%d %H:%M")
    with workdir(keep=args.keep, prefix="tokenmill-results-") as where, Children() as children:
        problems = main_run(args, where, children)
        if args.rss_rows:
            problems += rss_run(args, where, children)
    print(f"\nstarted {started}; {load.line()}")
    print("problems:" if problems else "no problem: every target met")
    for p in problems:
        print(f"- {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
