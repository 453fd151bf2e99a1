"""The pipeline end to end: real redis-server, real celery workers, the sim over HTTP."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson
import redis

from tests.pipeline import cli, expected_for, mixed_rows, read_export, wait_run_finished, write_jsonl
from tests.procs import Proc, start_sim, start_worker, worker_env
from tokenmill import keys

MAX_TOKENS = 120
MEAN = 40


def _routes(client: redis.Redis, run: str, urls: dict[str, str]) -> Counter[tuple[str, str, str]]:
    """Jobs counted by (the queue their prompt's length calls for, the queue in their ledger
    entry, the queue of the worker that ran them: each talks to a sim of its own, which the
    result names)."""
    worker_queue = {url: q for q, url in urls.items()}
    found: Counter[tuple[str, str, str]] = Counter()
    for key in client.scan_iter(keys.RunKeys(run).job("*")):
        queue, spec, result = client.hmget(key, "queue", "spec", "result")
        prompt = orjson.loads(spec)["request"]["messages"][-1]["content"]
        wanted = "long" if " long long" in prompt else "short"
        found[(wanted, queue.decode(), worker_queue[orjson.loads(result)["server"]])] += 1
    return found


def test_every_distinct_prompt_is_exported_once_with_the_sims_exact_text(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given 500 rows in two partitions: mixed messages/prompt rows, unicode, long prompts, and
    # exact duplicates (within a file and across files), and a sim with reasoning on
    b1_rows = mixed_rows("B1", 250)
    b2_rows = mixed_rows("B2", 240) + b1_rows[:5] + mixed_rows("B2", 5)  # 10 duplicates
    b1 = write_jsonl(tmp_path / "B1.jsonl", b1_rows)
    b2 = write_jsonl(tmp_path / "B2.jsonl", b2_rows)
    # (two identical sims, one per worker: each result names the sim, so the worker, that ran it)
    sims = {
        q: start_sim(tmp_path, "--reasoning-parser", "qwen3", "--sim-mean-output-tokens", str(MEAN))
        for q in keys.QUEUES
    }
    procs.extend(sim for sim, _ in sims.values())
    urls = {q: url for q, (_, url) in sims.items()}
    env = worker_env(redis_url, urls["short"])

    # When they are enqueued (twice) and two workers run, one started the plain Celery way
    flags = [
        "--short-max-tokens",
        str(MAX_TOKENS),
        "--long-max-tokens",
        str(MAX_TOKENS),
        "--long-prompt-tokens",
        "300",
    ]
    first = cli("enqueue", str(b1), str(b2), "--run", "synth", *flags, env=env)
    assert "490 new" in first.stdout and "10 already queued" in first.stdout, first.stdout
    again = cli("enqueue", str(b1), str(b2), "--run", "synth", *flags, env=env)
    assert "0 new" in again.stdout and "nothing to add" in again.stdout, again.stdout
    procs.append(start_worker(tmp_path, "short", env, concurrency=16))
    procs.append(
        start_worker(tmp_path, "long", worker_env(redis_url, urls["long"]), concurrency=4, via_celery=True)
    )
    doc = wait_run_finished(rclient, "synth", 150)

    # Then every distinct prompt is done exactly once and exported once, byte for byte
    assert doc["totals"] == {"queued": 0, "running": 0, "done": 490, "failed": 0, "total": 490}
    assert doc["stats"]["completion_tokens"] > 0
    out = tmp_path / "prepared"
    res = cli("export", "--run", "synth", "--out", str(out), "--include-truncated", env=env)
    exported = read_export(out)
    assert sorted(exported) == ["B1", "B2"], res.stdout
    assert len(exported["B1"]) == 250 and len(exported["B2"]) == 240
    seen = set()
    for partition, rows in exported.items():
        for row in rows:
            assert row["partition"] == partition
            key = orjson.dumps(row["messages"][:-1])
            assert key not in seen, "a prompt was exported twice"
            seen.add(key)
            want = expected_for(row, max_tokens=MAX_TOKENS, reasoning=True, mean_output_tokens=MEAN)
            got = row["messages"][-1]
            assert got["role"] == "assistant"
            assert got["content"] == want.content
            assert got.get("reasoning_content") == want.reasoning_content
            assert row["finish_reason"] == want.finish_reason
            assert row["usage"]["completion_tokens"] == want.completion_tokens
            assert set(row) == {"id", "partition", "messages", "finish_reason", "usage", "model", "metadata"}
    # prompt rows keep unknown fields as metadata; messages rows keep their metadata
    assert exported["B1"][1]["metadata"] == {"topic": "t1"}
    assert exported["B1"][0]["metadata"] == {"i": 0}
    # long prompts went to the long queue
    assert any(" long long" in r["messages"][-2]["content"] for r in exported["B1"])
    # and the worker consuming each queue ran exactly its jobs: 25 of B1's 250 rows and 24 of
    # B2's 240 distinct ones are long (every 10th)
    routes = _routes(rclient, "synth", urls)
    assert routes == {("long", "long", "long"): 49, ("short", "short", "short"): 441}, routes

    # Without --include-truncated, length-finished rows are left out
    out2 = tmp_path / "prepared2"
    cli("export", "--run", "synth", "--out", str(out2), env=env)
    kept = read_export(out2)
    assert all(r["finish_reason"] != "length" for rows in kept.values() for r in rows)
    assert sum(len(v) for v in kept.values()) == 490 - sum(
        r["finish_reason"] == "length" for rows in exported.values() for r in rows
    )

    # And re-enqueueing a finished run adds nothing
    third = cli("enqueue", str(b1), str(b2), "--run", "synth", *flags, env=env)
    assert "0 new" in third.stdout and "500 already done" in third.stdout, third.stdout
    status = orjson.loads(cli("status", "--run", "synth", "--json", env=env).stdout)
    assert set(status) >= {"run", "partitions", "totals", "tokens_per_s", "eta_s", "failures", "servers"}


def test_over_long_prompt_fails_once_and_a_mid_stream_error_is_retried(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a sim with a 2,000-token context that breaks every 3rd stream with a 503 error chunk
    sim, url = start_sim(tmp_path, "--context-length", "2000", "--sim-error-every", "3")
    procs.append(sim)
    env = worker_env(redis_url, url)
    rows = [{"id": f"ok{i}", "prompt": f"short question {i}"} for i in range(12)]
    rows.append({"id": "huge", "prompt": "word " * 4000})
    data = write_jsonl(tmp_path / "P.jsonl", rows)
    cli("enqueue", str(data), "--run", "r", "--short-max-tokens", "50", "--long-max-tokens", "50", env=env)
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    procs.append(start_worker(tmp_path, "long", env, concurrency=2))

    # When the run finishes
    doc = wait_run_finished(rclient, "r", 90)

    # Then the over-long prompt failed with the context-length class, after one attempt
    assert doc["totals"]["done"] == 12 and doc["totals"]["failed"] == 1
    assert doc["failures"] == {"context_length": 1}
    job = {k.decode(): v.decode() for k, v in rclient.hgetall("tm:r:job:P:huge").items()}
    assert job["attempts"] == "1" and "context length" in job["error"]
    # and the streams cut by an error chunk were retried to completion
    retried = [k for k in rclient.scan_iter("tm:r:job:P:ok*") if int(rclient.hget(k, "retries") or 0) > 0]
    assert retried, "the sim's error chunks should have forced at least one retry"
    assert all(rclient.hget(k, "last_error_class") == b"stream_error" for k in retried)
