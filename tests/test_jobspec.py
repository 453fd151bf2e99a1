"""Job ids: the producer's fast assembly of a job gives the same bytes and ids as the plain path."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from producer.enqueue import Routing
from producer.rows import normalize_row
from tokenmill.jobspec import JobSpec, canonical, canonical_request, content_hash

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
OPTIONS = [
    {},
    {"temperature": 0.7},
    {"top_p": 1.0, "seed": -4},
    {"temperature": 0.0, "top_p": 0.95, "seed": 12345678901},
    {"temperature": 1e-7, "seed": 0},
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
        options.get("temperature"),
        options.get("top_p"),
        options.get("seed"),
    )
    assert assembled == canonical(request)


@pytest.mark.parametrize(
    "data",
    [
        {"prompt": "Write a haiku", "lang": "en"},
        {"messages": REQUEST["messages"], "temperature": 0.2, "metadata": {"k": [1, 2]}},
        {"prompt": "with an id", "id": 17, "max_tokens": 9, "seed": 5},
    ],
)
def test_a_routed_row_is_the_job_the_plain_builder_makes(data: dict[str, Any]) -> None:
    routing = Routing(model="m", top_p=0.9)
    row = normalize_row("f.jsonl:1", data)

    fast = routing.spec(row, "P", "f.jsonl:1")
    plain = JobSpec.build(
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
