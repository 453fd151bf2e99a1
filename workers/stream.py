"""Streaming one chat completion from an SGLang server: the per-token hot path.

The official ``openai`` client sends the request (auth, headers, error mapping), but its typed
chunk objects cost ~5x the CPU of parsing the SSE line with orjson (measured on this machine
class before the worker was written), so the raw streaming response is read as bytes, split into
``data:`` lines here, and parsed with orjson. The request goes through the client's public
``post`` with the body already dumped by orjson: ``chat.completions.create`` first walks the
params through the SDK's typed transform, which cost about as much CPU per request as the
rest of sending it (bench/e2e.py --per-request). Per chunk the work is: one ``orjson.loads``, two
dict lookups, a list append and an integer increment. No Redis call, no allocation a buffer
would avoid; checkpoints are taken by the job's watchdog task from the shared ``Progress``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Any, cast

import httpx2
import orjson
from openai import AsyncOpenAI, AsyncStream

from tokenmill import errors
from workers import taxonomy

_DATA = b"data: "
# Every chunk carries the running usage, so checkpoints count tokens exactly even when a chunk
# holds several (``--stream-interval``): a continuation's max_tokens depends on that count.
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
_DONE = b"[DONE]"
_JSON = {"Content-Type": "application/json"}


@dataclass(slots=True)
class Progress:
    """What a stream has produced so far; read by the watchdog for checkpoints."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    chunks: int = 0
    last_chunk_at: float = 0.0
    first_chunk_at: float = 0.0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None

    @property
    def tokens(self) -> int:
        """Completion tokens so far: the server's running count, else one per chunk."""
        return int(self.usage["completion_tokens"]) if self.usage else self.chunks


async def stream_chat(
    client: AsyncOpenAI, request: dict[str, Any], extra: dict[str, Any], progress: Progress
) -> Progress:
    """Stream ``request`` and accumulate into ``progress``; raise a classified error on failure."""
    loop = asyncio.get_running_loop()
    try:
        body = orjson.dumps({**request, **extra, "stream": True, "stream_options": STREAM_OPTIONS})
        response = await client.post(
            "/chat/completions",
            cast_to=object,
            content=body,
            options={"headers": _JSON},
            stream=True,
            stream_cls=AsyncStream[Any],
        )
        try:
            http = response.response
            # The transport's byte stream: skips openai's iter_bytes and httpx2's aiter_bytes and
            # aiter_raw on every chunk (bench/e2e.py --per-token). SGLang's SSE is not
            # content-encoded; should a proxy encode it, httpx2 decodes it as before.
            chunks: AsyncIterable[bytes] = (
                http.aiter_bytes()
                if http.headers.get("content-encoding")
                else cast(httpx2.AsyncByteStream, http.stream)
            )
            buf = b""
            async for data in chunks:
                buf += data
                if b"\n" not in data:
                    continue
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.startswith(_DATA):
                        _on_line(line[6:], progress, loop)
            if buf.startswith(_DATA):
                _on_line(buf[6:], progress, loop)
        finally:
            await response.close()
    except errors.GenerationError:
        raise
    except Exception as exc:  # classified in one place
        raise taxonomy.from_exception(exc) from exc
    if progress.finish_reason is None:
        raise errors.StreamError("the stream ended without a finish_reason")
    if progress.finish_reason == "abort":
        raise errors.StreamError("the server aborted the request (finish_reason: abort)")
    return progress


def _on_line(payload: bytes, p: Progress, loop: asyncio.AbstractEventLoop) -> None:
    if payload.startswith(_DONE):
        return
    obj = orjson.loads(payload)
    choices = obj.get("choices")
    if choices:
        choice = choices[0]
        delta = choice.get("delta")
        if delta:
            text = delta.get("content")
            if text:
                p.content.append(text)
                p.chunks += 1
            text = delta.get("reasoning_content")
            if text:
                p.reasoning.append(text)
                p.chunks += 1
        reason = choice.get("finish_reason")
        if reason:
            p.finish_reason = reason
        p.last_chunk_at = loop.time()
        if not p.first_chunk_at:
            p.first_chunk_at = p.last_chunk_at
            p.model = obj.get("model")
    elif "error" in obj:
        raise taxonomy.from_error_chunk(obj)
    usage = obj.get("usage")
    if usage:
        p.usage = usage
