"""Streaming one chat completion from an SGLang server: the per-token hot path.

The stream is read on aiohttp's connections (:mod:`workers.transport`): each chunk of the body
reaches :class:`_Lines`, is split into ``data:`` lines and parsed with orjson. The openai
client's typed chunk objects cost ~5x the CPU of that parse (measured on this machine class
before the worker was written). Per chunk the work is: one ``orjson.loads``, two dict lookups, a
list append and an integer increment. No Redis call; checkpoints are taken by the process's
watch (:mod:`workers.watch`) from the shared ``Progress``. An error answer is classified from
its status and body in :mod:`workers.taxonomy`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import orjson

from tokenmill import __version__, errors
from workers import taxonomy
from workers.transport import HttpClient

_DATA = b"data: "
# Every chunk carries the running usage, so checkpoints count tokens exactly even when a chunk
# holds several (``--stream-interval``): a continuation's max_tokens depends on that count.
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
_DONE = b"[DONE]"


@dataclass(slots=True)
class Progress:
    """What a stream has produced so far; read by the watch for deadlines and checkpoints."""

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


class StreamClient:
    """One server's chat completions endpoint for the stream path: its URL, the request's
    headers (built once) and the connections its streams are read on. Built once per server per
    process."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        connect_timeout_s: float = 10.0,
        answer_timeout_s: float | None = None,
    ) -> None:
        parts = urlsplit(f"{url.rstrip('/')}/v1/chat/completions")
        # without any user:password@ (the key goes in its own header)
        self.url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.http = HttpClient(connect_timeout_s, answer_timeout_s)
        self.headers = {
            "Authorization": f"Bearer {api_key or 'EMPTY'}",
            "User-Agent": f"tokenmill/{__version__}",
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",
            "Content-Type": "application/json",
        }

    @classmethod
    def of(
        cls, url: str, api_key: str | None, connect_timeout_s: float, answer_timeout_s: float | None = None
    ) -> StreamClient:
        """The client for the server at ``url`` (its root, as in ``TOKENMILL_SERVER_URL``); a
        request no answer (headers) comes back for in ``answer_timeout_s`` fails."""
        return cls(url, api_key, connect_timeout_s, answer_timeout_s)

    async def close(self) -> None:
        await self.http.close()


async def stream_chat(
    client: StreamClient, request: dict[str, Any], extra: dict[str, Any], progress: Progress
) -> Progress:
    """Stream ``request`` and accumulate into ``progress``; raise a classified error on failure."""
    lines = _Lines(progress, asyncio.get_running_loop())
    try:
        body = orjson.dumps({**request, **extra, "stream": True, "stream_options": STREAM_OPTIONS})
        response = await client.http.post(client.url, body, client.headers, lines.feed)
        if not 200 <= response.status < 300:
            raise taxonomy.from_answer(response.status, response.body)
        lines.end()
    except errors.GenerationError:
        raise
    except Exception as exc:  # classified in one place
        raise taxonomy.from_exception(exc) from exc
    if progress.finish_reason is None:
        raise errors.StreamError("the stream ended without a finish_reason")
    if progress.finish_reason == "abort":
        raise errors.StreamError("the server aborted the request (finish_reason: abort)")
    return progress


class _Lines:
    """The body of a stream, as it arrives: split into lines, each ``data:`` line parsed."""

    __slots__ = ("buf", "loop", "progress")

    def __init__(self, progress: Progress, loop: asyncio.AbstractEventLoop) -> None:
        self.buf = b""
        self.progress = progress
        self.loop = loop

    def feed(self, data: bytes) -> None:
        if b"\n" not in data:
            self.buf += data
            return
        *lines, self.buf = (self.buf + data).split(b"\n") if self.buf else data.split(b"\n")
        for line in lines:
            if line.startswith(_DATA):
                _on_line(line[6:], self.progress, self.loop)

    def end(self) -> None:
        if self.buf.startswith(_DATA):
            _on_line(self.buf[6:], self.progress, self.loop)
        self.buf = b""


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
