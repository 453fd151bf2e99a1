"""Streaming one chat completion from an SGLang server: the per-token hot path.

The official ``openai`` client owns the connection (its aiohttp transport and pool), the API
key and the error types, but its typed chunk objects cost ~5x the CPU of parsing the SSE line
with orjson (measured on this machine class before the worker was written), so the raw streaming
response is read as bytes, split into ``data:`` lines here, and parsed with orjson. The request
goes straight to the transport the client's HTTP client would use, with headers and timeouts
built once per client (``Route``): the SDK's request pipeline (option copies, header merging,
retries the worker turns off) cost 0.90 ms of CPU per request against 0.45 for a bare aiohttp
request, this path 0.41 against 0.29 (bench/e2e.py --per-request), and ``chat.completions.create``
more than the pipeline. A 4xx or 5xx answer becomes the SDK's own ``APIStatusError``
(``_make_status_error_from_response``), classified as before. Per
chunk the work is: one ``orjson.loads``, two dict lookups, a list append and an integer
increment. No Redis call, no allocation a buffer would avoid; checkpoints are taken by the job's
process's watch (:mod:`workers.watch`) from the shared ``Progress``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Any, cast

import httpx2
import orjson
from openai import AsyncOpenAI

from tokenmill import errors
from workers import taxonomy

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


async def stream_chat(
    client: AsyncOpenAI, request: dict[str, Any], extra: dict[str, Any], progress: Progress
) -> Progress:
    """Stream ``request`` and accumulate into ``progress``; raise a classified error on failure."""
    loop = asyncio.get_running_loop()
    try:
        route = Route.of(client)
        body = orjson.dumps({**request, **extra, "stream": True, "stream_options": STREAM_OPTIONS})
        post = httpx2.Request("POST", route.url, headers=route.headers, content=body, extensions=route.ext)
        try:
            http = await route.transport.handle_async_request(post)
        except httpx2.TransportError as exc:  # no answer at all: as the SDK's connection errors
            raise taxonomy.from_send_error(exc) from exc
        http.request = post
        try:
            if http.status_code >= 400:
                await http.aread()
                raise client._make_status_error_from_response(http)
            # The transport's byte stream: skips httpx2's aiter_bytes and aiter_raw on every
            # chunk (bench/e2e.py --per-token). SGLang's SSE is not content-encoded; should a
            # proxy encode it, httpx2 decodes it.
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
            await http.aclose()
    except errors.GenerationError:
        raise
    except Exception as exc:  # classified in one place
        raise taxonomy.from_exception(exc) from exc
    if progress.finish_reason is None:
        raise errors.StreamError("the stream ended without a finish_reason")
    if progress.finish_reason == "abort":
        raise errors.StreamError("the server aborted the request (finish_reason: abort)")
    return progress


@dataclass(frozen=True, slots=True)
class Route:
    """Where a client's chat completions go, with which headers and on which transport: built
    once per client. The request goes to the transport the client's HTTP client would pick, with
    its timeouts; the HTTP client's own layers (auth flow, redirects, event hooks, cookies, a
    timing wrapper around every chunk) do nothing for these requests."""

    transport: httpx2.AsyncBaseTransport
    url: httpx2.URL
    headers: dict[str, str]
    ext: dict[str, Any]  # the request's extensions: its timeouts

    @staticmethod
    def of(client: AsyncOpenAI) -> Route:
        route = _ROUTES.get(client)
        if route is None:
            route = _ROUTES[client] = Route.build(client)
        return route

    @staticmethod
    def build(client: AsyncOpenAI) -> Route:
        headers = {
            **client.auth_headers,
            "Accept": "text/event-stream",
            "Content-Type": "application/json",
            "User-Agent": client.user_agent,
        }
        http, url = client._client, client.base_url.join("chat/completions")
        return Route(http._transport_for_url(url), url, headers, {"timeout": http.timeout.as_dict()})


_ROUTES: weakref.WeakKeyDictionary[AsyncOpenAI, Route] = weakref.WeakKeyDictionary()


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
