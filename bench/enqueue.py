"""Enqueue throughput: tokenmill's bulk path vs. Celery ``send_task`` vs. raw pipelined LPUSH.

Side by side in one run, on one private redis-server (AOF on, as in production), flushed between
variants; every variant leaves one broker message per row (checked):

- tokenmill, in process: ``producer.enqueue.Enqueuer`` over the JSONL file (read, validate,
  route, content-hash ids, ledger create-if-absent with dedup, Celery messages pushed inside
  the enqueue script, 200 rows per script call, two calls in flight on one connection);
- tokenmill, CLI: ``tokenmill enqueue FILE`` as a subprocess, end to end (interpreter start,
  imports, the durability check), with its max RSS from ``wait4``;
- tokenmill, re-enqueue: the same file again, every row a dedup hit (nothing written);
- Celery ``apply_async``: ``generate.apply_async(args=[run, partition, id], queue=...)`` per row
  on one reused producer (the issue's "plain apply_async loop", with tokenmill's own task and its
  small message), on the first ``--apply-rows`` rows;
- Celery ``send_task``: ``app.send_task("tokenmill.generate", args=[request], queue=...)`` per row
  (the row's chat request in the message, the hand-written way), on the same rows;
- raw: each row's JSON line LPUSHed, pipelined in batches of 1,000 (a floor: no parsing,
  no ids, no dedup, no envelope).

For the in-process variant the run also reports CPU per row: the producer's (its process time)
and Redis's (``used_cpu_user + used_cpu_sys`` from INFO), and the rate those two costs allow at
best on this machine's cores, however well they overlap.

``--rss-rows N`` also runs the CLI over an N-row file (written streaming) and reports its max RSS.

    .venv/bin/python bench/enqueue.py                      # 100k rows, 5k send_task: ~1 minute
    .venv/bin/python bench/enqueue.py --rss-rows 1000000   # and the CLI over 1M rows: ~2 minutes more
"""

from __future__ import annotations

import argparse
import os
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
    exit_on_sigterm,
    machine,
    median,
    run_measured,
    table,
    verdict,
    wait_for,
    wait_quiet,
    workdir,
)

from producer.enqueue import Enqueuer, Routing
from tokenmill import keys
from tokenmill.ledger import Ledger
from tokenmill.settings import Settings

RUN = "bench"
BATCH = 1000
WORDS = (
    "the of and to in is that for it as was with be by on not this are or from at which have an "
    "model token cache queue server stream batch prompt ledger worker lease retry GPU kernel tensor "
    "café naïve résumé über 日本 東京 中文 한국어 русский 🙂 🚀 explain prove derive compare summarize"
).split()
LONG_EVERY = 100  # one row in 100 has a prompt over --long-prompt-tokens (the long queue)
LONG_PROMPT_TOKENS = 4096


# --- the dataset ---------------------------------------------------------------------------------


def _text(rng: random.Random, n_words: int, i: int) -> str:
    return f"#{i}: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def dataset_rows(n: int, seed: int = 7) -> Iterator[dict[str, Any]]:
    """``n`` distinct rows, as the workload has them: chat ``messages`` or a ``prompt``, metadata."""
    rng = random.Random(seed)
    for i in range(n):
        long = i % LONG_EVERY == LONG_EVERY - 1
        text = _text(rng, 3500 if long else rng.randint(20, 110), i)
        if i % 2:
            yield {"prompt": text, "source": "synthetic", "difficulty": i % 5}
        else:
            yield {
                "messages": [
                    {"role": "system", "content": "Think step by step."},
                    {"role": "user", "content": text},
                ],
                "metadata": {"i": i, "topic": rng.choice(WORDS)},
            }


def write_dataset(path: Path, n: int) -> Path:
    """Write ``n`` rows as JSONL, streaming (never the whole file in memory)."""
    with open(path, "wb") as f:
        chunk: list[bytes] = []
        for row in dataset_rows(n):
            chunk.append(orjson.dumps(row))
            if len(chunk) >= 10_000:
                f.write(b"\n".join(chunk) + b"\n")
                chunk = []
        if chunk:
            f.write(b"\n".join(chunk) + b"\n")
    return path


# --- the variants --------------------------------------------------------------------------------


def broker_depth(client: redis.Redis) -> int:
    return sum(int(client.llen(keys.broker_queue(q))) for q in keys.QUEUES)


def redis_cpu_s(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def tokenmill_in_process(client: redis.Redis, path: Path, rows: int) -> tuple[float, str, float, float]:
    """Seconds to enqueue ``path`` with the producer's Enqueuer, its summary line, and the CPU
    seconds the producer and Redis spent on it."""
    enq = Enqueuer(Ledger(client, RUN), Routing(model="default", long_prompt_tokens=LONG_PROMPT_TOKENS), rows)
    redis0, cpu0 = redis_cpu_s(client), time.process_time()
    start = time.perf_counter()
    enq.enqueue_file(path)
    elapsed = time.perf_counter() - start
    cpu, redis_cpu = time.process_time() - cpu0, redis_cpu_s(client) - redis0
    return elapsed, enq.summary.line(RUN), cpu, redis_cpu


def cli_args(path: Path, redis_url: str, rows: int) -> list[str]:
    return [
        sys.executable, "-m", "tokenmill.cli", "enqueue", str(path), "--run", RUN,
        "--long-prompt-tokens", str(LONG_PROMPT_TOKENS), "--max-queued", str(rows), "--redis-url", redis_url,
    ]  # fmt: skip


def celery_send_task(redis_url: str, path: Path, rows: int) -> float:
    """Seconds to publish the first ``rows`` rows with ``send_task`` on one reused producer."""
    from tokenmill.app import configure

    app = configure(Settings.load(redis_url=redis_url))
    routing = Routing(model="default", long_prompt_tokens=LONG_PROMPT_TOKENS)
    with open(path, "rb") as f, app.producer_or_acquire() as producer:
        app.send_task("tokenmill.generate", args=[{}], queue="short", producer=producer)  # connect, warm up
        start = time.perf_counter()
        for _, line in zip(range(rows), f, strict=False):
            row = orjson.loads(line)
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            queue = "long" if len(line) > routing.long_prompt_tokens * 4 else "short"
            request = {"model": "default", "messages": messages, "max_tokens": 10240}
            app.send_task("tokenmill.generate", args=[request], queue=queue, producer=producer)
        elapsed = time.perf_counter() - start
    return elapsed


def celery_apply_async(redis_url: str, path: Path, rows: int) -> float:
    """Seconds to publish the first ``rows`` rows with ``generate.apply_async`` on one reused
    producer; the row is read and parsed, its id is its line number."""
    from tokenmill.app import TASK_NAME, configure

    app = configure(Settings.load(redis_url=redis_url))
    import workers.task  # noqa: F401  (registers the task)

    generate = app.tasks[TASK_NAME]
    with open(path, "rb") as f, app.producer_or_acquire() as producer:
        generate.apply_async(args=[RUN, "P", "warm-up"], queue="short", producer=producer)
        start = time.perf_counter()
        for i, line in zip(range(rows), f, strict=False):
            orjson.loads(line)
            queue = "long" if len(line) > LONG_PROMPT_TOKENS * 4 else "short"
            generate.apply_async(args=[RUN, "P", str(i)], queue=queue, producer=producer)
        elapsed = time.perf_counter() - start
    return elapsed


def raw_lpush(client: redis.Redis, path: Path) -> float:
    """Seconds to LPUSH every line of ``path``, pipelined, 1,000 per round trip."""
    key = keys.broker_queue("short")
    start = time.perf_counter()
    with open(path, "rb") as f:
        pipe = client.pipeline(transaction=False)
        n = 0
        for line in f:
            pipe.lpush(key, line.rstrip(b"\n"))
            n += 1
            if n % BATCH == 0:
                pipe.execute()
        pipe.execute()
    return time.perf_counter() - start


# --- the run -------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000, help="rows in the dataset (default 100,000)")
    ap.add_argument("--apply-rows", type=int, default=5_000, help="rows sent with send_task (default 5,000)")
    ap.add_argument("--rss-rows", type=int, default=0, help="also run the CLI over an N-row file (RSS check)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of all variants; medians are reported")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    a = ap.parse_args()
    exit_on_sigterm()
    apply_rows = min(a.apply_rows, a.rows)
    print(f"machine: {machine()}")
    print(f"busy cores before the start: {wait_quiet():.2f} (waits up to 2 min for an idle machine)")
    with workdir(a.keep) as work, Children() as children:
        load = MachineLoad()
        server = children.redis(work / "redis")
        client = redis.Redis.from_url(server.url, socket_timeout=600)  # FLUSHALL of 1M jobs is slow
        # A background AOF rewrite (a fork) landing inside one variant would skew it: rewrite
        # after each flush instead, between variants.
        client.config_set("auto-aof-rewrite-percentage", 0)
        print(f"redis-server {client.info('server')['redis_version']} on {server.url} (AOF everysec)")
        data = write_dataset(work / "bench.jsonl", a.rows)
        print(f"dataset: {a.rows:,} rows, {data.stat().st_size / 1e6:.1f} MB ({a.rows // LONG_EVERY:,} long)")
        rounds = []
        for i in range(a.repeat):
            rounds.append(measure(client, server.url, data, a.rows, apply_rows, work))
            r = rates(rounds[-1])
            done = ", ".join(f"{k} {v:,.0f} rows/s" for k, v in r.items())
            print(f"round {i + 1}: {done}; tokenmill / apply_async {r['tokenmill'] / r['apply_async']:.1f}x")
        rss_line = measure_rss(client, server.url, work, a.rss_rows) if a.rss_rows else None
        print(load.line())
    report(rounds, a.rows, apply_rows, rss_line)


def flush(client: redis.Redis) -> None:
    """An empty database and a rewritten (empty) AOF, so that every variant starts alike."""
    client.flushall()
    client.bgrewriteaof()
    wait_for(lambda: not int(client.info("persistence")["aof_rewrite_in_progress"]), 120, "the AOF rewrite")
    wait_for(lambda: not int(client.info("persistence")["aof_rewrite_scheduled"]), 120, "the AOF rewrite")


def measure(
    client: redis.Redis, url: str, data: Path, rows: int, apply_rows: int, work: Path
) -> dict[str, Any]:
    """One round of every variant; seconds (and the CLI's measurements)."""
    out: dict[str, Any] = {"rows": rows, "apply_rows": apply_rows}

    flush(client)
    out["raw_s"] = raw_lpush(client, data)
    assert broker_depth(client) == rows, "raw LPUSH: one message per row"

    flush(client)
    tm = tokenmill_in_process(client, data, rows)
    out["tm_s"], out["tm_line"], out["tm_cpu_s"], out["tm_redis_cpu_s"] = tm
    assert broker_depth(client) == rows, "tokenmill: one message per row"
    out["tm_again_s"], out["tm_again_line"], _, _ = tokenmill_in_process(client, data, rows)
    assert broker_depth(client) == rows, "re-enqueue publishes nothing"

    flush(client)
    out["celery_s"] = celery_send_task(url, data, apply_rows)
    assert broker_depth(client) == apply_rows + 1, "send_task: one message per row (and the warm-up)"

    flush(client)
    out["apply_s"] = celery_apply_async(url, data, apply_rows)
    assert broker_depth(client) == apply_rows + 1, "apply_async: one message per row (and the warm-up)"

    flush(client)
    cli = run_measured(cli_args(data, url, rows), work / "cli.log")
    if cli.returncode != 0:
        raise RuntimeError(f"tokenmill enqueue exited {cli.returncode}:\n{cli.output[-2000:]}")
    assert broker_depth(client) == rows, "CLI: one message per row"
    out["cli"] = cli
    return out


def rates(r: dict[str, Any]) -> dict[str, float]:
    rows = r["rows"]
    return {
        "tokenmill": rows / r["tm_s"],
        "cli": rows / r["cli"].wall_s,
        "re-enqueue": rows / r["tm_again_s"],
        "send_task": r["apply_rows"] / r["celery_s"],
        "apply_async": r["apply_rows"] / r["apply_s"],
        "raw": rows / r["raw_s"],
    }


def measure_rss(client: redis.Redis, url: str, work: Path, rows: int) -> list[Any]:
    t0 = time.perf_counter()
    big = write_dataset(work / "rss.jsonl", rows)
    written = time.perf_counter() - t0
    flush(client)
    res = run_measured(cli_args(big, url, rows), work / "cli-rss.log")
    if res.returncode != 0:
        raise RuntimeError(f"tokenmill enqueue exited {res.returncode}:\n{res.output[-2000:]}")
    assert broker_depth(client) == rows
    size_mb = big.stat().st_size / 1e6
    big.unlink()
    print(f"(wrote the {rows:,}-row file, {size_mb:.0f} MB, in {written:.1f} s, streaming)")
    return [f"`tokenmill enqueue` CLI, {rows:,} rows", f"{res.wall_s:.1f}", f"{rows / res.wall_s:,.0f}",
            f"{res.max_rss_mb:.0f}", verdict(res.max_rss_mb < 500)]  # fmt: skip


def report(rounds: list[dict[str, Any]], rows: int, apply_rows: int, rss_line: list[Any] | None) -> None:
    per = [rates(r) for r in rounds]
    m = {k: median([p[k] for p in per]) for k in per[0]}
    tm, cli, apply, raw = m["tokenmill"], m["cli"], m["apply_async"], m["raw"]
    send = m["send_task"]
    n = len(rounds)
    print()
    print(rounds[0]["tm_line"])
    print(rounds[0]["tm_again_line"])
    print()
    print(f"median of {n} round(s), each variant on a flushed Redis:")

    def line(name: str, count: int, rate: float) -> list[str]:
        ratios = [f"{rate / apply:.1f}x", f"{rate / send:.1f}x", f"{rate / raw:.3f}"]
        return [name, f"{count:,}", f"{rate:,.0f}", *ratios]

    print(table(
        ["variant", "rows", "rows/s", "vs apply_async", "vs send_task", "vs raw LPUSH"],
        [
            line("tokenmill Enqueuer (in process)", rows, tm),
            line("`tokenmill enqueue` CLI (subprocess, end to end)", rows, cli),
            line("tokenmill re-enqueue (every row a dedup hit)", rows, m["re-enqueue"]),
            line("Celery apply_async, one reused producer", apply_rows, apply),
            line("Celery send_task (request in the message), one reused producer", apply_rows, send),
            line("raw pipelined LPUSH of the JSON lines", rows, raw),
        ],
    ))  # fmt: skip
    if apply_rows < rows:
        print(f"(apply_async and send_task ran on the first {apply_rows:,} rows only: {rows:,} would take "
              f"~{rows / apply:.0f} s at this rate; --apply-rows {rows} runs them all)")  # fmt: skip
    print()
    print(f"tokenmill vs apply_async: {tm / apply:.1f}x (target >= 25x: {verdict(tm / apply >= 25)}); "
          f"vs raw LPUSH: {tm / raw:.2f} (target >= 0.2: {verdict(tm / raw >= 0.2)})")  # fmt: skip
    cpu_us = median([r["tm_cpu_s"] / rows * 1e6 for r in rounds])
    redis_us = median([r["tm_redis_cpu_s"] / rows * 1e6 for r in rounds])
    cores = len(os.sched_getaffinity(0))
    bound = cores / ((cpu_us + redis_us) / 1e6)
    print(
        f"CPU per row (in process): producer {cpu_us:.1f} us, redis-server {redis_us:.1f} us; "
        f"on {cores} cores that allows at most {bound:,.0f} rows/s ({bound / apply:.1f}x apply_async) "
        "however well the two overlap"
    )
    print()
    rss = max(r["cli"].max_rss_mb for r in rounds)
    rss_rows = [[f"`tokenmill enqueue` CLI, {rows:,} rows", f"{min(r['cli'].wall_s for r in rounds):.1f}",
                 f"{cli:,.0f}", f"{rss:.0f}", verdict(rss < 500)]]  # fmt: skip
    if rss_line:
        rss_rows.append(rss_line)
    print(table(["producer process", "seconds", "rows/s", "max RSS MB", "target < 500 MB"], rss_rows))


if __name__ == "__main__":
    main()
