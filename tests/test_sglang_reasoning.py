"""Reasoning and multi-token chunks, one test body for the sim and SGLang 0.5.23.

The engines run with ``--reasoning-parser deepseek-r1`` (the tiny model's chat template opens a
think block, so its output is reasoning until a ``</think>``) and ``--stream-interval 4``
(several tokens per chunk: tokenmill must count them from the usage, not the chunks).
"""

from __future__ import annotations

import math

import pytest

from tests.engines import DEEPSEEK_INTERVAL, Engine
from tests.sglang_client import chat, sse_frames, stream, stream_options
from tokenmill.settings import Settings
from tokenmill.transitions import Checkpoint, Claim
from workers.attempt import build_request

INTERVAL = DEEPSEEK_INTERVAL  # the shared deepseek engine's --stream-interval
USER = [{"role": "user", "content": "Think about caches, then answer. Ünïcödé δέλτα 日本語 🚀"}]


@pytest.fixture(scope="module")
def engine(deepseek_engine: Engine) -> Engine:
    return deepseek_engine


def greedy(max_tokens: int) -> dict:
    return {"model": "tm", "messages": USER, "max_tokens": max_tokens, "temperature": 0}


def test_the_reasoning_parser_streams_the_thinking_as_reasoning_content(engine: Engine) -> None:
    progress = stream(engine, greedy(24))
    message = chat(engine, USER, max_tokens=24, temperature=0)["choices"][0]["message"]

    assert progress.reasoning, "the output starts with reasoning"
    assert "".join(progress.reasoning) == message["reasoning_content"]
    assert "".join(progress.content) == (message["content"] or "")
    assert progress.tokens == 24 and progress.finish_reason == "length"


def test_chunks_carry_several_tokens_and_the_usage_counts_them_exactly(engine: Engine) -> None:
    frames = sse_frames(engine, {**greedy(24), **stream_options()})
    chunks = [f for f in frames[:-1] if f["choices"] and f["choices"][0]["finish_reason"] is None][1:]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    progress = stream(engine, greedy(24))

    assert len(chunks) <= math.ceil(24 / INTERVAL) + 1, counts
    assert max(b - a for a, b in zip([0, *counts], counts, strict=False)) >= INTERVAL, counts
    assert frames[-2]["usage"]["completion_tokens"] == 24
    assert progress.tokens == 24 and progress.chunks < 24


def test_reasoning_deltas_carry_reasoning_content_and_no_role(engine: Engine) -> None:
    frames = sse_frames(engine, greedy(12))
    deltas = [f["choices"][0]["delta"] for f in frames[1:-1] if f["choices"]]

    assert any(d.get("reasoning_content") for d in deltas)
    assert all("role" not in d for d in deltas)
    assert all(isinstance(d.get("content"), str | None) for d in deltas)


def test_a_checkpoint_inside_the_reasoning_is_continued_as_reasoning(engine: Engine) -> None:
    first = stream(engine, greedy(16))
    partial = "".join(first.reasoning)[: len("".join(first.reasoning)) // 2]
    claim = Claim("r", "j", "1", 2, {"request": greedy(32)}, Checkpoint(), "p", "short", 0)
    request, extra = build_request(claim, Settings(), Checkpoint(content="", reasoning=partial, tokens=8))

    progress = stream(engine, request, extra)

    assert request["messages"][-1] == {"role": "assistant", "content": partial}
    assert extra["continue_final_message"] is True and request["max_tokens"] == 24
    assert progress.tokens == 24 and progress.finish_reason == "length"
    assert progress.reasoning, "the continuation stays in the think block"
    assert progress.usage is not None and first.usage is not None
    assert progress.usage["prompt_tokens"] > first.usage["prompt_tokens"]
