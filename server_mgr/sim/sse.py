"""Byte builders for chat completion chunks and responses, in SGLang 0.5.23's shapes (§3.3-3.5).

The per-token path is hot (hundreds of streams, ~10k tokens/s on a shared 2-core box): each
stream precomputes its chunk prefix and suffix once, so a chunk costs one ``orjson.dumps`` of
the delta text and two concatenations.
"""

from __future__ import annotations

from typing import Any

import orjson

from server_mgr.sim.textgen import EOS_TOKEN_ID

DONE = b"data: [DONE]\n\n"
_TAIL = b'},"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'


def _usage_tail(usage: bytes) -> bytes:
    return b'},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":' + usage + b"}\n\n"


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


def matched_stop(finish_reason: str) -> int | None:
    """A natural stop matched the EOS token; length and abort match nothing."""
    return EOS_TOKEN_ID if finish_reason == "stop" else None


def error_chunk(message: str, type_: str, code: int) -> bytes:
    """A mid-stream error event (§3.5)."""
    err = {"object": "error", "message": message, "type": type_, "param": None, "code": code}
    return b"data: " + orjson.dumps({"error": err}) + b"\n\n"


class ChunkEncoder:
    """SSE events of one chat stream; ``id``, ``created`` and ``model`` are fixed per stream."""

    __slots__ = ("_content", "_head", "_reasoning", "_top")

    def __init__(self, rid: str, created: int, model: str) -> None:
        self._top = (
            b'{"id":'
            + orjson.dumps(rid)
            + b',"object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + orjson.dumps(model)
        )
        self._head = b"data: " + self._top + b',"choices":[{"index":0,"delta":{'
        self._content = self._head + b'"reasoning_content":null,"content":'
        self._reasoning = self._head + b'"reasoning_content":'

    def role(self) -> bytes:
        return self._head + b'"reasoning_content":null,"role":"assistant","content":""' + _TAIL

    def content(self, text: str, usage: bytes = b"") -> bytes:
        """A content delta; ``usage`` (``continuous_usage_stats``) rides on the chunk when given."""
        return self._content + orjson.dumps(text) + (_usage_tail(usage) if usage else _TAIL)

    def reasoning(self, text: str, usage: bytes = b"") -> bytes:
        return self._reasoning + orjson.dumps(text) + (_usage_tail(usage) if usage else _TAIL)

    def finish(self, finish_reason: str) -> bytes:
        """The separate finish chunk, with an empty delta."""
        tail = orjson.dumps(
            {"logprobs": None, "finish_reason": finish_reason, "matched_stop": matched_stop(finish_reason)}
        )
        return self._head + b'"reasoning_content":null},' + tail[1:-1] + b"}]}\n\n"

    def usage(self, prompt: int, completion: int, reasoning: int) -> bytes:
        body = orjson.dumps(usage_body(prompt, completion, reasoning))
        return b"data: " + self._top + b',"choices":[],"usage":' + body + b"}\n\n"


def chat_response(
    *,
    rid: str,
    created: int,
    model: str,
    reasoning_content: str | None,
    content: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    reasoning_tokens: int,
) -> bytes:
    """A non-streaming ``chat.completion`` body (§3.3)."""
    return orjson.dumps(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": content or None,
                        "reasoning_content": reasoning_content or None,
                    },
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "matched_stop": matched_stop(finish_reason),
                }
            ],
            "usage": usage_body(prompt_tokens, completion_tokens, reasoning_tokens),
            "metadata": {"weight_version": "default"},
        }
    )
