"""Job ids: the producer's fast assembly of a job gives the same bytes and ids as the plain path."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from producer.enqueue import Routing
from producer.rows import normalize_row
from tests.test_ledger import build_spec
from tokenmill.jobspec import canonical, canonical_request, content_hash

REQUEST = {
    "model": "Qwen/Qwen3-8B",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Écris un haïku ✍", "name": "ann"},
    ],
    "max_tokens": 512,
    "temperature": 0.7,
    "top_p": 0.95,
    "seed": 3,
}


def test_content_ids_do_not_change_between_versions() -> None:
    # Pinned: a changed id would make every re-enqueue of an existing run a new set of jobs.
    assert content_hash(REQUEST) == "852df713d25c07ba6a6e3c50d2f43ba8"
    plain = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10240}
    assert content_hash(plain) == "c7bd1c980385a4235beb1fe5f8a1d253"


MESSAGES: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    REQUEST["messages"],  # type: ignore[list-item]
    [{"content": "z", "role": "user", "name": "b", "extra": {"y": 1, "x": [2.5, None]}}],
    [{"role": "user", "content": [{"type": "text", "text": "look"}, {"text": "again", "type": "text"}]}],
    [{"role": "user", "content": 'quotes " and \\ and \n and \u2028 and 🙂'}],
]
SCALAR_OPTIONS = [
    {},
    {"temperature": 0.7},
    {"top_p": 1.0, "seed": -4},
    {"temperature": 0.0, "top_p": 0.95, "seed": 12345678901},
    {"temperature": 1e-7, "seed": 0},
]
SCHEMA = {"type": "object", "properties": {"why": {"type": "string"}, "answer": {"type": "integer"}}}
OPTIONS = [
    *SCALAR_OPTIONS,
    {"stop": ["\n\n", "END"], "top_k": 20, "logprobs": True, "top_logprobs": 3},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "qa", "schema": SCHEMA}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}], "tool_choice": "auto"},
    {"chat_template_kwargs": {"enable_thinking": False}, "regex": "[a-z]+"},
]


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("model", ["default", "Qwen/Qwen3-8B", 'odd "model" ✍'])
def test_the_assembled_request_is_byte_for_byte_the_canonical_one(
    messages: list[dict[str, Any]], options: dict[str, Any], model: str
) -> None:
    request = {"model": model, "messages": messages, "max_tokens": 77, **options}
    assembled = canonical_request(
        orjson.dumps(model),
        orjson.dumps(messages, option=orjson.OPT_SORT_KEYS),
        77,
        {k: orjson.dumps(v) for k, v in options.items()},
    )
    assert assembled == canonical(request)
    assert orjson.loads(assembled) == request


@pytest.mark.parametrize("options", SCALAR_OPTIONS)
def test_requests_with_scalar_options_hash_as_before_options_existed(options: dict[str, Any]) -> None:
    # Before request options, the canonical form was every key sorted (nested ones too)
    request = {"model": "m", "messages": MESSAGES[2], "max_tokens": 9, **options}
    assert canonical(request) == orjson.dumps(request, option=orjson.OPT_SORT_KEYS)


def test_an_options_own_key_order_is_kept_and_is_part_of_the_id() -> None:
    # The order of a schema's properties is the order SGLang generates them in
    swapped = {**SCHEMA, "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    fmt = {"type": "json_schema", "json_schema": {"name": "qa", "schema": SCHEMA}}
    a = {"model": "m", "messages": MESSAGES[0], "max_tokens": 9, "response_format": fmt}
    b = {**a, "response_format": {**fmt, "json_schema": {"name": "qa", "schema": swapped}}}

    stored = orjson.loads(canonical(a))["response_format"]["json_schema"]["schema"]["properties"]
    assert list(stored) == ["why", "answer"]
    assert content_hash(a) != content_hash(b)


@pytest.mark.parametrize(
    "data",
    [
        {"prompt": "Write a haiku", "lang": "en"},
        {"messages": REQUEST["messages"], "temperature": 0.2, "metadata": {"k": [1, 2]}},
        {"prompt": "with an id", "id": 17, "max_tokens": 9, "seed": 5},
        {"prompt": "options", "stop": "END", "top_p": 0.5, "response_format": {"type": "json_object"}},
    ],
)
def test_a_routed_row_is_the_job_the_plain_builder_makes(data: dict[str, Any]) -> None:
    routing = Routing(model="m", params={"top_p": 0.9, "stop": ["\n"]})
    row = normalize_row("f.jsonl:1", data)

    fast = routing.spec(row, "P", "f.jsonl:1")
    plain = build_spec(
        partition="P",
        queue=fast.queue,
        source="f.jsonl:1",
        request=fast.request,
        metadata=row.metadata,
        record_id=row.record_id,
    )

    assert fast.request["top_p"] == data.get("top_p", 0.9)
    assert (fast.job_id, fast.digest, fast.to_json()) == (plain.job_id, plain.digest, plain.to_json())
    assert orjson.loads(fast.to_json()) == {
        "request": fast.request,
        "metadata": row.metadata,
        "record_id": row.record_id,
    }
