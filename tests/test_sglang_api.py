"""``tokenmill api`` on both engines, the sim and SGLang 0.5.23: a batch sent with the real
``openai`` SDK runs through real Redis and a real celery worker, and its files say what the
server answered (each output a solo greedy regeneration; a refused request with its status)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai import OpenAI

from tests.engines import API_KEY, CONTEXT_LEN, Engine
from tests.procs import Proc, http_status, spawn, start_worker, wait_for, worker_env
from tests.sglang_client import chat
from tokenmill.local_redis import free_port

KEY = "k-batch"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine(plain_engine: Engine) -> Engine:
    return plain_engine


@pytest.fixture
def api(engine: Engine, tmp_path: Path, redis_url: str, procs: list[Proc]) -> OpenAI:
    """A worker per queue and a ``tokenmill api`` process on ``engine``; the SDK's client for the API."""
    env = worker_env(redis_url, engine.url, api_key=API_KEY)
    env.update(
        {
            "TOKENMILL_API_KEYS": KEY,
            "TOKENMILL_RESULTS_URL": str(tmp_path / "store"),
            "TOKENMILL_API_POLL_S": "0.2",
        }
    )
    # the over-long prompt is routed to the long queue (an estimate past 4096 tokens)
    procs += [start_worker(tmp_path, "short", env, concurrency=4), start_worker(tmp_path, "long", env, 1)]
    port = free_port()
    args = [sys.executable, "-m", "tokenmill.cli", "api", "--port", str(port)]
    proc = spawn(args, tmp_path / "api.log", env=env)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}/v1"
    wait_for(lambda: http_status(url + "/files") == 401 or not proc.alive(), 30, "tokenmill api listening")
    assert proc.alive(), proc.output()
    return OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=30)


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"batch question {i}: name a colour"}]


def line(custom_id: str, msgs: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "gpt-4o-mini", "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def content(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [orjson.loads(x) for x in client.files.content(file_id).read().splitlines()]


def test_a_batch_runs_on_the_engine_and_the_request_it_refuses_is_in_the_error_file(
    engine: Engine, api: OpenAI
) -> None:
    # Given a Batch input file of five greedy requests and one whose prompt is over the model's
    # context
    lines = [line(f"req-{i}", messages(i)) for i in range(5)]
    lines.append(line("too-long", [{"role": "user", "content": "word " * (CONTEXT_LEN + 800)}]))
    f = api.files.create(
        file=("input.jsonl", b"".join(orjson.dumps(x) + b"\n" for x in lines)), purpose="batch"
    )

    # When it runs as a batch through the openai SDK
    batch = api.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    ended = ("completed", "failed", "expired", "cancelled")
    done = wait_for(
        lambda: (b := api.batches.retrieve(batch.id)).status in ended and b, 180, f"batch {batch.id} to end"
    )

    # Then it completed with one output line per answered custom_id, each the same request
    # regenerated alone
    assert done.status == "completed", done.errors
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (6, 5, 1)
    out = content(api, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == [f"req-{i}" for i in range(5)]
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200, o
        got = o["response"]["body"]["choices"][0]
        i = int(o["custom_id"].removeprefix("req-"))
        solo = chat(engine, messages(i), max_tokens=MAX_TOKENS, temperature=0)["choices"][0]
        assert got["message"]["content"] == solo["message"]["content"], o["custom_id"]
        assert got["finish_reason"] == solo["finish_reason"]
    # And the refused request is the error file's one line, with the server's 400 and its text
    (refused,) = content(api, done.error_file_id)
    assert refused["custom_id"] == "too-long" and refused["response"]["status_code"] == 400
    error = refused["response"]["body"]["error"]
    assert error["code"] == "context_length"
    assert re.fullmatch(
        rf"The input \(\d+ tokens\) is longer than the model's context length \({CONTEXT_LEN} tokens\)\.",
        error["message"],
    ), error["message"]
