"""A run on real greedy engines whose streams were cut, checked end to end: nothing lost, nothing
repeated, each continued result starting with its checkpoint, every other result equal to its
request regenerated alone (greedy output is the same alone and in a batch, and on every server
started from the same model directory and seed). Shared by the pipeline's server-kill test and
the router's."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import orjson
import redis

from tests.chaos import all_job_ids, results, state_counts
from tests.engines import Engine
from tests.pipeline import cli, read_export
from tests.sglang_client import chat
from tokenmill import keys

CHECKPOINT_FIELDS = ["ckpt_content", "ckpt_reasoning", "ckpt_tokens"]


def checkpoints(client: redis.Redis, run: str) -> dict[str, dict[str, Any]]:
    """The checkpoint each job of ``run`` holds (content, reasoning, tokens), if any."""
    k = keys.RunKeys(run)
    out = {}
    for job_id in all_job_ids(client, run):
        content, reasoning, tokens = client.hmget(
            k.job(job_id), ["ckpt_content", "ckpt_reasoning", "ckpt_tokens"]
        )
        if int(tokens or 0) > 0:
            out[job_id] = {
                "content": content.decode(),
                "reasoning": (reasoning or b"").decode(),
                "tokens": int(tokens),
            }
    return out


def solo(
    engine: Engine, client: redis.Redis, run: str, job_id: str, prompt_only: bool = False
) -> dict[str, Any]:
    """A job's request regenerated alone (its first token only with ``prompt_only``)."""
    request = orjson.loads(client.hget(keys.RunKeys(run).job(job_id), "spec"))["request"]
    max_tokens = 1 if prompt_only else request["max_tokens"]
    return chat(engine, request["messages"], max_tokens=max_tokens, temperature=0)


def spec_ids(client: redis.Redis, run: str, ids: list[str]) -> list[str]:
    k = keys.RunKeys(run)
    return [orjson.loads(client.hget(k.job(j), "spec")).get("record_id") or j for j in ids]


def assert_exact_after_cuts(
    client: redis.Redis,
    run: str,
    total: int,
    engine: Engine,
    cut: dict[str, dict[str, Any]],
    max_tokens: int,
    env: dict[str, str],
    out: Path,
    must_continue: frozenset[str] = frozenset(),
) -> int:
    """Check the finished ``run`` of ``total`` jobs, some cut mid-stream, against ``engine``: a
    continued result must start with its checkpoint in ``cut`` (a job continued from a
    checkpoint not there fails), and the jobs of ``must_continue`` must have continued. Returns
    how many results were continued from a checkpoint."""
    # every prompt is done once, none failed; the run's token count is the results' sum
    assert state_counts(client, run) == {"queued": 0, "running": 0, "done": total, "failed": 0}
    ids = all_job_ids(client, run)
    got = results(client, run, ids)
    stats = {k.decode(): int(v) for k, v in client.hgetall(keys.RunKeys(run).stats()).items()}
    assert stats["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in got.values())
    # the export has each row once
    cli("export", "--run", run, "--out", str(out), "--include-truncated", env=env)
    exported = [row for rows in read_export(out).values() for row in rows]
    assert sorted(r["id"] for r in exported) == sorted(spec_ids(client, run, ids))

    # each continued result starts with its checkpoint and its usage adds up, while every other
    # result equals its solo regeneration
    was_cut = {j for j, r in got.items() if r["continued_tokens"] > 0}
    assert must_continue <= was_cut, sorted(must_continue - was_cut)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # (a continued job is compared with its solo's prompt only: one token of it will do)
        solos = dict(
            zip(ids, pool.map(lambda j: solo(engine, client, run, j, j in was_cut), ids), strict=True)
        )
    for job_id, result in got.items():
        alone, usage = solos[job_id], result["usage"]
        assert usage["prompt_tokens"] == alone["usage"]["prompt_tokens"], job_id
        if job_id not in was_cut:
            assert result["content"] == alone["choices"][0]["message"]["content"], job_id
            assert usage["completion_tokens"] == alone["usage"]["completion_tokens"]
            continue
        ck = cut.get(job_id)
        assert ck is not None, (job_id, result["continued_tokens"], "continued from a checkpoint not known")
        assert result["continued_tokens"] == ck["tokens"], (job_id, result, ck)
        assert result["content"].startswith(ck["content"]), job_id
        assert (result["reasoning_content"] or "").startswith(ck["reasoning"])
        if result["finish_reason"] == "length":
            assert usage["completion_tokens"] == max_tokens, (job_id, usage)
        else:
            assert ck["tokens"] < usage["completion_tokens"] < max_tokens, (job_id, usage)
    return len(was_cut)
