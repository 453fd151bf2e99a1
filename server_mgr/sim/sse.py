"""Byte builders for chat completion chunks and responses, in SGLang 0.5.23's shapes (§3.3-3.5).

The per-token path is hot (hundreds of streams, ~10k tokens/s on a shared 2-core box): each
stream precomputes its chunk prefix and suffix once, so a chunk costs one ``orjson.dumps`` of
the delta text and two concatenations.
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def _tail(logprobs: bytes = b"", usage: bytes = b"") -> bytes:
    """The end of a one-choice chunk after its delta: ``logprobs`` and ``usage`` JSON or empty."""
    tail = b'},"logprobs":' + (logprobs or b"null") + b',"finish_reason":null,"matched_stop":null}]'
    return tail + (b',"usage":' + usage if usage else b"") + b"}\n\n"


_TAIL = _tail()


def usage_body(prompt: int, completion: int, reasoning: int) -> dict[str, Any]:
    """The ``usage`` object of 0.5.23."""
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
    }


def error_chunk(message: str, type_: str, code: int) -> bytes:
    """A mid-stream error event (§3.5)."""
    err = {"object": "error", "message": message, "type": type_, "param": None, "code": code}
    return b"data: " + orjson.dumps({"error": err}) + b"\n\n"


class ChunkEncoder:
    """SSE events of one chat stream; ``id``, ``created`` and ``model`` are fixed per stream."""

    __slots__ = ("_content", "_head", "_index", "_reasoning", "_top")

    def __init__(self, rid: str, created: int, model: str, index: int = 0) -> None:
        self._top = (
            b'{"id":'
            + orjson.dumps(rid)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(model)
        )
        self._index = index
        self._head = b"data: " + self._top + b',"choices":[{"index":' + str(index).encode() + b',"delta":{'
        self._content = self._head + b'"reasoning_content":null,"content":'
        self._reasoning = self._head + b'"reasoning_content":'

    def role(self) -> bytes:
        return self._head + b'"reasoning_content":null,"role":"assistant","content":""' + _TAIL

    def content(self, text: str, usage: bytes = b"", logprobs: bytes = b"") -> bytes:
        """A content delta; ``usage`` (``continuous_usage_stats``) and ``logprobs`` (the entries
        of this step's tokens) ride on the chunk when given."""
        return self._content + orjson.dumps(text) + (_tail(logprobs, usage) if usage or logprobs else _TAIL)

    def reasoning(self, text: str, usage: bytes = b"", logprobs: bytes = b"") -> bytes:
        return self._reasoning + orjson.dumps(text) + (_tail(logprobs, usage) if usage or logprobs else _TAIL)

    def bare(self, logprobs: bytes, usage: bytes = b"") -> bytes:
        """A chunk with an empty delta carrying the step's ``logprobs`` (what SGLang sends when a
        parser took the step's text)."""
        return self._head + b'"reasoning_content":null' + _tail(logprobs, usage)

    def model_chunk(self, delta: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
        """A chunk SGLang builds with pydantic (tool-call deltas and the text around them):
        every delta field present, null when unset, and a top-level ``usage``."""
        full = {"role": None, "content": None, "reasoning_content": None, **delta}
        choice = {"index": self._index, "delta": full, "logprobs": None}
        choice |= {"finish_reason": None, "matched_stop": None}
        body = orjson.dumps({"choices": [choice], "usage": usage})
        return b"data: " + self._top + b"," + body[1:] + b"\n\n"

    def finish(self, finish_reason: str, matched: int | str | None) -> bytes:
        """The separate finish chunk, with an empty delta."""
        tail = orjson.dumps({"logprobs": None, "finish_reason": finish_reason, "matched_stop": matched})
        return self._head + b'"reasoning_content":null},' + tail[1:-1] + b"}]}\n\n"

    def sglext(self, output_ids: list[list[int]]) -> bytes:
        """The chunk with ``sglext.output_ids`` (``return_output_ids_in_sglext``), before usage."""
        body = orjson.dumps({"choices": [], "usage": None, "sglext": {"output_ids": output_ids}})
        return b"data: " + self._top + b"," + body[1:] + b"\n\n"

    def usage(self, prompt: int, completion: int, reasoning: int) -> bytes:
        body = orjson.dumps(usage_body(prompt, completion, reasoning))
        return b"data: " + self._top + b',"choices":[],"usage":' + body + b"}\n\n"


def response_choice(
    index: int,
    message: dict[str, Any],
    extra: dict[str, Any],
    finish_reason: str,
    matched_stop: int | str | None,
) -> dict[str, Any]:
    """One choice of a ``chat.completion``: ``message`` is the assistant message, ``extra`` holds
    ``logprobs`` and the token id fields."""
    return {
        "index": index,
        "message": {"role": "assistant", **message},
        "logprobs": extra.get("logprobs"),
        "finish_reason": finish_reason,
        "matched_stop": matched_stop,
        **{k: v for k, v in extra.items() if k != "logprobs"},
    }


def chat_response(
    *,
    rid: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    prompt_tokens: int,
    completion_tokens: int,
    reasoning_tokens: int,
    sglext: dict[str, Any] | None = None,
) -> bytes:
    """A non-streaming ``chat.completion`` body (§3.3)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(prompt_tokens, completion_tokens, reasoning_tokens),
        "metadata": {"weight_version": "default"},
    }
    if sglext:
        body["sglext"] = sglext
    return orjson.dumps(body)
