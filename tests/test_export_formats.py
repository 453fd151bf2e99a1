"""What a job with request options brings back is exported in every format, from Redis and from
sealed shards alike: tool calls in the assistant message, matched_stop, logprobs, output token
ids; and an OpenAI Batch input file comes out as OpenAI Batch output lines, failed and cancelled
requests included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
import redis

from tests import sealing
from tests.finishing import all_job_ids
from tests.pipeline import cli, write_jsonl
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.transitions import Claim, JobError

USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
LOGPROBS = {
    "content": [
        {
            "token": "Hi",
            "logprob": -0.5,
            "bytes": [72, 105],
            "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}],
        },
        {
            "token": "!",
            "logprob": -1.25,
            "bytes": [33],
            "top_logprobs": [{"token": "!", "logprob": -1.25, "bytes": [33]}],
        },
    ]
}


def batch_line(custom_id: str, **body: Any) -> dict[str, Any]:
    body = {"model": "gpt-4o-mini", "messages": USER, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


INPUT = [
    batch_line("tool", tools=[TOOL], tool_choice="required", max_tokens=30),
    batch_line("stop", stop=["END"], max_tokens=30),
    batch_line("lp", logprobs=True, top_logprobs=1, return_token_ids=True, max_tokens=2),
    batch_line("long", max_tokens=4),
    batch_line("bad", max_tokens=30, seed=1),
    batch_line("gone", max_tokens=30, seed=2),
]
RESULTS: dict[str, dict[str, Any]] = {
    "tool": {"content": "", "finish_reason": "tool_calls", "tool_calls": [CALL], "completion_tokens": 9},
    "stop": {
        "content": "It is sunny",
        "finish_reason": "stop",
        "matched_stop": "END",
        "completion_tokens": 4,
    },
    "lp": {
        "content": "Hi!",
        "finish_reason": "length",
        "logprobs": LOGPROBS,
        "output_token_ids": [500, 33],
        "completion_tokens": 2,
    },
    "long": {"content": "one two three four", "finish_reason": "length", "completion_tokens": 4},
}


def _finish(client: redis.Redis, run: str) -> None:
    """Commit the crafted results through the ledger, as a worker commits; fail one (the one
    left queued is cancelled by the fixture)."""
    ledger = Ledger(client, run)
    for job_id in all_job_ids(client, run):
        name = job_id.split(":", 1)[1]
        if name == "gone":
            continue
        claim = ledger.call(t.claim(ledger.k, job_id, "tester", 60))
        assert isinstance(claim, Claim)
        if name == "bad":
            assert (
                ledger.call(
                    t.fail(ledger.k, claim, JobError("context_length", "Requested token count exceeds 8192"))
                )
                == "ok"
            )
            continue
        want = RESULTS[name]
        result = {k: v for k, v in want.items() if k != "completion_tokens"}
        result |= {
            "usage": {"prompt_tokens": 11, "completion_tokens": want["completion_tokens"]},
            "model": "default",
        }
        result |= {"reasoning_content": None, "attempt": 1, "continued_tokens": 0}
        assert ledger.call(t.commit(ledger.k, claim, result, want["completion_tokens"])) == "ok"


@pytest.fixture
def batch_run(tmp_path: Path, rclient: redis.Redis, redis_url: str) -> dict[str, str]:
    env = sealing.sealing_env(redis_url, tmp_path / "store")
    path = write_jsonl(tmp_path / "in.jsonl", INPUT)
    cli("enqueue", str(path), "--run", "b", "--partition", "batch", env=env)
    _finish(rclient, "b")
    cli("cancel", "--run", "b", env=env)
    return env


def _lines(data: bytes) -> dict[str, dict[str, Any]]:
    rows = [orjson.loads(x) for x in data.splitlines()]
    return {r.get("custom_id") or r["id"]: r for r in rows}


def test_every_field_a_job_brought_back_is_in_the_jsonl_row(
    tmp_path: Path, batch_run: dict[str, str]
) -> None:
    rows = _lines(sealing.export(batch_run, "b", tmp_path / "j")["batch.jsonl"])

    assert sorted(rows) == ["long", "lp", "stop", "tool"]  # failed and cancelled ones are not rows
    tool = rows["tool"]["messages"][-1]
    assert tool == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert rows["tool"]["finish_reason"] == "tool_calls"
    assert rows["stop"]["matched_stop"] == "END" and "matched_stop" not in rows["long"]
    assert rows["lp"]["logprobs"] == LOGPROBS and rows["lp"]["output_token_ids"] == [500, 33]
    assert rows["tool"]["metadata"] == {"model": "gpt-4o-mini"}


@pytest.mark.parametrize("sealed", [False, True])
def test_the_openai_batch_export_answers_every_request_of_the_input(
    tmp_path: Path, rclient: redis.Redis, batch_run: dict[str, str], sealed: bool
) -> None:
    if sealed:
        sealing.seal(batch_run, "--all")
        assert sealing.sealed_count(rclient, "b") == 4  # every done job is read from its shard
    out = tmp_path / "o"
    res = cli("export", "--run", "b", "--out", str(out), "--format", "openai-batch", env=batch_run)
    lines = _lines((out / "batch.jsonl").read_bytes())

    # One line per request of the input, under its own custom_id
    assert sorted(lines) == sorted(x["custom_id"] for x in INPUT)
    assert "1 failed (written with their error)" in res.stdout and "1 cancelled (written" in res.stdout
    ok = lines["tool"]
    assert ok["error"] is None and ok["id"].startswith("batch_req_")
    assert ok["response"]["status_code"] == 200 and ok["response"]["request_id"].startswith("req_")
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [CALL]},
         "logprobs": None, "finish_reason": "tool_calls"}
    ]  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20}
    assert lines["lp"]["response"]["body"]["choices"][0]["logprobs"] == LOGPROBS
    assert lines["stop"]["response"]["body"]["choices"][0]["matched_stop"] == "END"
    assert lines["long"]["response"]["body"]["choices"][0]["finish_reason"] == "length"  # truncated too
    bad = lines["bad"]["response"]
    assert bad["status_code"] == 400 and lines["bad"]["error"] is None
    assert bad["body"]["error"]["message"] == "Requested token count exceeds 8192"
    assert bad["body"]["error"]["code"] == "context_length"
    assert lines["gone"]["response"] is None and lines["gone"]["error"]["code"] == "batch_cancelled"
    # A second export writes the same lines but for the time of the export
    again = _lines(
        cli("export", "--run", "b", "--out", str(tmp_path / "o2"), "--format", "openai-batch", env=batch_run)
         and (tmp_path / "o2" / "batch.jsonl").read_bytes()
    )  # fmt: skip
    for line in (*lines.values(), *again.values()):
        if line["response"] and line["response"]["status_code"] == 200:
            line["response"]["body"]["created"] = 0
    assert again == lines


@pytest.mark.parametrize("sealed", [False, True])
def test_the_parquet_export_types_tool_calls_logprobs_and_token_ids(
    tmp_path: Path, rclient: redis.Redis, batch_run: dict[str, str], sealed: bool
) -> None:
    if sealed:
        sealing.seal(batch_run, "--all")
        assert sealing.sealed_count(rclient, "b") == 4
    jsonl = _lines(sealing.export(batch_run, "b", tmp_path / "j")["batch.jsonl"])
    sealing.export(batch_run, "b", tmp_path / "p", "--format", "parquet")
    table = pq.read_table(tmp_path / "p" / "batch.parquet")

    assert str(table.schema.field("output_token_ids").type) == "list<element: int64>"
    assert "tool_calls: list<element: struct<id: string, type: string, function: struct" in str(
        table.schema.field("messages").type
    )
    assert str(table.schema.field("logprobs").type).startswith(
        "struct<content: list<element: struct<token: string"
    )

    def without_nulls(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in d.items() if v is not None}

    rows = {row["id"]: row for row in table.to_pylist()}
    assert rows["lp"]["output_token_ids"] == [500, 33] and rows["lp"]["logprobs"] == LOGPROBS
    assert rows["lp"]["messages"][-1]["content"] == "Hi!" and rows["tool"]["output_token_ids"] is None
    for row in rows.values():
        got = without_nulls(row)
        got["metadata"] = orjson.loads(got["metadata"])
        got["messages"] = [without_nulls(m) for m in got["messages"]]
        want = jsonl[row["id"]]
        assert got == {**want, "messages": [without_nulls(m) for m in want["messages"]]}
