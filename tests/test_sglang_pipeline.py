"""The pipeline on both engines, the sim and SGLang 0.5.23: real Redis, real celery workers.

A mixed dataset runs end to end and every result equals a solo greedy regeneration of its request
(greedy output is the same alone and inside a batch); the server is SIGKILLed mid-run and
restarted, and nothing is lost, nothing repeated, and each continued result starts with its
checkpoint; a wrong API key stops the workers claiming, once, without failing a job.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.status import run_status
from tests.chaos import all_job_ids, running_jobs, state_counts, wait_finished
from tests.continued import assert_exact_after_cuts
from tests.continued import checkpoints as job_checkpoints
from tests.engines import API_KEY, CONTEXT_LEN, ENGINE_PARAMS, Engine, spared_engine
from tests.keyspace import key_events
from tests.pipeline import cli, read_export, wait_run_finished, write_jsonl
from tests.procs import Proc, start_worker, wait_for, worker_env
from tests.sglang_client import chat, post_json
from tokenmill import keys

WORDS = ["alpha", "beta", "gamma", "δέλτα", "日本語", "emoji🙂", "naïve", "zeta"]
# long enough that streams are cut mid-way: the kill comes once three jobs hold a checkpoint (one
# every 8 tokens), while eight streams share the tiny model's ~300 tokens/s
MAX_TOKENS = 400
CHAOS_SIM = ("--sim-step-ms", "5")  # the sim at ~200 tokens/s a stream: cut mid-way all the same


@pytest.fixture(scope="module")
def engine(plain_engine: Engine) -> Engine:
    return plain_engine


def mixed_rows(tag: str, n: int) -> list[dict[str, Any]]:
    """``prompt`` and ``messages`` rows with unicode; every fifth a long prompt."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        text = f"{tag} question {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(i % 6 + 2))
        if i % 5 == 4:
            text += " long" * 300
        if i % 2:
            rows.append({"prompt": text, "topic": f"t{i % 3}"})
        else:
            rows.append(
                {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]}
            )
    return rows


def regenerate(engine: Engine, row: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The exported row's request sent alone, greedy: what an uninterrupted run produces."""
    return chat(engine, row["messages"][:-1], max_tokens=max_tokens, temperature=0)


def test_a_mixed_dataset_runs_exactly_once_and_each_result_equals_its_solo_regeneration(
    engine: Engine, tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given two files of prompt and messages rows with unicode, long prompts, duplicates within
    # and across files, and one prompt longer than the model's context
    b1_rows = mixed_rows("B1", 14)
    b1_rows += [b1_rows[0], b1_rows[3], {"prompt": "word " * (CONTEXT_LEN + 800)}]
    b2_rows = [*mixed_rows("B2", 8), b1_rows[1], b1_rows[2]]
    files = [write_jsonl(tmp_path / "B1.jsonl", b1_rows), write_jsonl(tmp_path / "B2.jsonl", b2_rows)]
    env = worker_env(redis_url, engine.url, api_key=API_KEY)
    flags = ["--temperature", "0", "--short-max-tokens", "24", "--long-max-tokens", "32"]

    # When they are enqueued and workers run on the short and the long queue
    out = cli("enqueue", *map(str, files), "--run", "mixed", *flags, "--long-prompt-tokens", "200", env=env)
    assert "23 new (long 4, short 19)" in out.stdout and "4 already queued" in out.stdout, out.stdout
    procs.append(start_worker(tmp_path, "short", env, concurrency=6))
    procs.append(start_worker(tmp_path, "long", env, concurrency=2, via_celery=True))
    wait_finished(rclient, "mixed", 23, 300)

    # Then every distinct prompt ran once: 22 done, the over-long one failed as context_length
    # with SGLang's own 400 text
    assert state_counts(rclient, "mixed") == {"queued": 0, "running": 0, "done": 22, "failed": 1}
    failed = _jobs_in(rclient, "mixed", "failed")
    assert len(failed) == 1
    assert failed[0]["error_class"] == "context_length"
    assert re.fullmatch(
        rf"The input \(\d+ tokens\) is longer than the model's context length \({CONTEXT_LEN} tokens\)\.",
        failed[0]["error"],
    ), failed[0]["error"]
    long_jobs = [j for j in _jobs_in(rclient, "mixed", "done") if " long long" in j["spec"]]
    assert len(long_jobs) == 3 and {j["queue"] for j in [*long_jobs, failed[0]]} == {"long"}

    # And each exported row equals the same request regenerated alone
    cli("export", "--run", "mixed", "--out", str(tmp_path / "out"), "--include-truncated", env=env)
    exported = read_export(tmp_path / "out")
    assert {p: len(rows) for p, rows in exported.items()} == {"B1": 14, "B2": 8}
    for rows in exported.values():
        for row in rows:
            long = " long long" in row["messages"][-2]["content"]
            solo = regenerate(engine, row, 32 if long else 24)
            assert row["messages"][-1]["content"] == solo["choices"][0]["message"]["content"], row["id"]
            assert row["finish_reason"] == solo["choices"][0]["finish_reason"]
            assert row["usage"] == {k: solo["usage"][k] for k in ("prompt_tokens", "completion_tokens")}


def test_a_jobs_log_probabilities_cover_every_token_on_a_server_whose_stream_drops_some(
    engine: Engine, tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a greedy job asking for log-probabilities whose output ends on the EOS token, on a
    # server with no reasoning or tool-call parser: streamed, the entries of a step with no text
    # (the EOS, a part of a character) are lost (docs/sglang-conformance.md)
    regex, user = "(yes|no), [a-z]{3,9}", "logprobs to the end"
    row = {"id": "lp", "prompt": user, "regex": regex, "logprobs": True, "max_tokens": 40}
    env = worker_env(redis_url, engine.url, api_key=API_KEY)
    cli(
        "enqueue", str(write_jsonl(tmp_path / "L.jsonl", [row])), "--run", "lp", "--temperature", "0", env=env
    )

    # When a worker runs it and the run is exported
    procs.append(start_worker(tmp_path, "short", env, concurrency=1))
    wait_finished(rclient, "lp", 1, 120)
    assert state_counts(rclient, "lp")["done"] == 1, _jobs_in(rclient, "lp", "failed")[0]["error"]
    cli("export", "--run", "lp", "--out", str(tmp_path / "out"), env=env)
    (got,) = read_export(tmp_path / "out")["L"]

    # Then its entries are those of the same request answered whole: one per token, EOS included
    whole = post_json(engine, "/v1/chat/completions", {
        "model": "default", "temperature": 0, "regex": regex, "logprobs": True, "max_tokens": 40,
        "messages": [{"role": "user", "content": user}],
    })[1]  # fmt: skip
    want = whole["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in got["logprobs"]["content"]] == [e["token"] for e in want]
    assert len(want) == got["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


@pytest.mark.parametrize("kind", ENGINE_PARAMS)
def test_a_server_killed_mid_run_and_restarted_loses_nothing_and_continues_from_checkpoints(
    kind: str, tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a worker streaming 16 greedy prompts of MAX_TOKENS tokens from an engine
    with spared_engine(kind, tmp_path, sim_flags=CHAOS_SIM) as server:
        rows = [
            {"prompt": f"chaos {i}: " + " ".join(WORDS[(i + j) % 8] for j in range(i % 5 + 2))}
            for i in range(16)
        ]
        env = worker_env(redis_url, server.url)
        cli("enqueue", str(write_jsonl(tmp_path / "C.jsonl", rows)), "--run", "chaos", "--temperature", "0",
            "--short-max-tokens", str(MAX_TOKENS), env=env)  # fmt: skip
        procs.append(start_worker(tmp_path, "short", env, concurrency=8))
        wait_for(lambda: sum(v.ckpt_tokens > 0 for v in running_jobs(rclient, "chaos").values()) >= 3, 120,
                 "three jobs mid-stream with a checkpoint", 0.05)  # fmt: skip

        # When the whole server is SIGKILLed, its streams are released with their checkpoints,
        # and another comes up at its address
        os.killpg(server.engine.proc.pgid, signal.SIGKILL)
        wait_for(lambda: not running_jobs(rclient, "chaos"), 60, "the cut streams to be released")
        checkpoints = job_checkpoints(rclient, "chaos")
        assert len(checkpoints) >= 3, checkpoints
        engine = server.replace()
        wait_finished(rclient, "chaos", 16, 300)

        # Then every prompt is done once, none failed, no retry was burned by the outage, and
        # each job cut holds on from its checkpoint while every other result equals its solo
        continued = assert_exact_after_cuts(
            rclient,
            "chaos",
            16,
            engine,
            checkpoints,
            MAX_TOKENS,
            env,
            tmp_path / "out",
            frozenset(checkpoints),
        )
        ids = all_job_ids(rclient, "chaos")
        assert all(int(rclient.hget(keys.RunKeys("chaos").job(j), "retries") or 0) == 0 for j in ids)
        assert continued >= 3


def _hold_while_alone(client: redis.Redis, run: str, passes: int) -> list[dict[str, int]]:
    """Look at the run until the (only) worker's pump has taken its lock ``passes`` times; each
    look: the failed and done totals, the retries spent and the claims made (attempts)."""
    samples = []
    seen = 0
    pattern = keys.RunKeys(run).job("*")
    with key_events(client, keys.upkeep_lock()) as events:

        def look() -> bool:
            nonlocal seen
            seen += sum(event == "set" for _, event in events.read())
            totals = run_status(client, run)["totals"]
            jobs = [client.hmget(k, "retries", "attempts") for k in client.scan_iter(pattern)]
            sample = {"failed": totals["failed"], "done": totals["done"]}
            sample["retries"], sample["attempts"] = (sum(int(j[i] or 0) for j in jobs) for i in (0, 1))
            samples.append(sample)
            return seen >= passes

        wait_for(look, 30, f"{passes} passes of the worker's pump")
    return samples


def test_a_wrong_api_key_stops_the_worker_claiming_without_failing_jobs(
    engine: Engine, tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given an engine that requires an API key and a worker configured with the wrong one
    url = engine.url
    data = write_jsonl(tmp_path / "P.jsonl", [{"prompt": f"q{i}"} for i in range(6)])
    cli(
        "enqueue", str(data), "--run", "r", "--short-max-tokens", "16", env={"TOKENMILL_REDIS_URL": redis_url}
    )
    # (with two attempts per job, a worker that spent retries on the 401 would soon fail jobs)
    bad_env = worker_env(redis_url, url, api_key="wrong-key", max_attempts=2)
    bad = start_worker(tmp_path, "short", bad_env, concurrency=2)
    procs.append(bad)

    # When it meets the 401, it says so once and stops consuming; no job fails
    wait_for(lambda: "refused the API key" in bad.output(), 30, "the worker to report the refused key")
    wait_for(
        lambda: (
            "cancel_consumer" in bad.output()
            or "Canceling queue" in bad.output()
            or "canceling" in bad.output().lower()
        ),
        20,
        "the worker to stop consuming",
    )
    doc = run_status(rclient, "r")
    assert doc["totals"]["failed"] == 0 and doc["totals"]["done"] == 0
    # and as long as it runs alone (three passes of its pump, which promotes delayed retries),
    # at every look: no job failed or done, no retry spent, no claim beyond its two threads' first
    samples = _hold_while_alone(rclient, "r", passes=3)
    assert all(s["failed"] == s["done"] == s["retries"] == 0 and s["attempts"] <= 2 for s in samples), samples
    assert bad.output().count("refused the API key") == 1
    assert "wrong-key" not in bad.output()

    # Then a worker with the right key finishes the run
    procs.append(start_worker(tmp_path, "short", worker_env(redis_url, url, api_key=API_KEY), concurrency=2))
    assert wait_run_finished(rclient, "r", 60)["totals"]["done"] == 6


def _jobs_in(client: redis.Redis, run: str, state: str) -> list[dict[str, str]]:
    k = keys.RunKeys(run)
    out = []
    for job_id in all_job_ids(client, run):
        job = {a.decode(): b.decode() for a, b in client.hgetall(k.job(job_id)).items()}
        if job.get("state") == state:
            out.append(job)
    return out
