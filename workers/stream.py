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
import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenmill import errors
from tokenmill.options import SGLEXT_OUTPUT_IDS
from tokenmill.url_secrets import split_userinfo
from workers import taxonomy
from workers.transport import BodySink, HttpClient

VERSION = importlib.metadata.version("tokenmill")
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
    matched_stop: str | int | None = None
    # Read only for requests that ask for them (:func:`handler_for`); the plain path never looks.
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None
    output_ids: list[int] | None = None
    guard: StopGuard | None = None
    whole: bool = False  # answered whole (whole_chat): no chunk comes before the end
    # called once, at the first chunk (the prompt is prefilled and in the server's prefix cache)
    on_first: Callable[[], None] | None = None

    @property
    def tokens(self) -> int:
        """Completion tokens so far: the server's running count, else one per chunk."""
        return int(self.usage["completion_tokens"]) if self.usage else self.chunks


class StreamClient:
    """One server's chat completions endpoint for the stream path: its URL, the request's
    headers (built once) and the connections its streams are read on. Built once per server per
    process. ``url`` is the server's root, as in ``TOKENMILL_SERVER_URL``; a request no answer
    (headers) comes back for in ``answer_timeout_s`` fails."""

    def __init__(
        self, url: str, api_key: str | None, connect_timeout_s: float, answer_timeout_s: float | None = None
    ) -> None:
        self.server = url.rstrip("/")  # its root, as the pool names it
        # without any user:password@: that logs in by basic auth when there is no key
        self.url, basic = split_userinfo(f"{self.server}/v1/chat/completions")
        self.http = HttpClient(connect_timeout_s, answer_timeout_s)
        self.headers = {
            "Authorization": f"Bearer {api_key}" if api_key else basic or "Bearer EMPTY",
            "User-Agent": f"tokenmill/{VERSION}",
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",
            "Content-Type": "application/json",
        }

    async def close(self) -> None:
        await self.http.close()


async def stream_chat(
    client: StreamClient, request: dict[str, Any], extra: dict[str, Any], progress: Progress
) -> Progress:
    """Stream ``request`` and accumulate into ``progress``; raise a classified error on failure."""
    lines = _Lines(progress, asyncio.get_running_loop(), handler_for(request, progress))
    body = {**request, **extra, "stream": True, "stream_options": STREAM_OPTIONS}
    return await _exchange(client, body, lines.feed, lines.end, progress)


LineHandler = Callable[[bytes, Progress, asyncio.AbstractEventLoop], None]


async def whole_chat(
    client: StreamClient, request: dict[str, Any], extra: dict[str, Any], progress: Progress
) -> Progress:
    """Send ``request`` unstreamed and fill ``progress`` from the whole answer; raise a
    classified error on failure (for jobs a stream would give less: ``options.answered_whole``)."""
    loop = asyncio.get_running_loop()
    body: list[bytes] = []

    def end() -> None:
        _fill(progress, orjson.loads(b"".join(body)), loop.time())

    request = {**request, **extra, "stream": False}
    return await _exchange(client, request, body.append, end, progress)


async def _exchange(
    client: StreamClient, request: dict[str, Any], sink: BodySink, end: Callable[[], None], progress: Progress
) -> Progress:
    """POST ``request``: its answer's body to ``sink`` as it arrives, then ``end()``; raise a
    classified error on failure."""
    streamed = request["stream"]
    try:
        body = orjson.dumps(request)
        response = await client.http.post(client.url, body, client.headers, sink, unstreamed=not streamed)
        if not 200 <= response.status < 300:
            raise taxonomy.from_answer(response.status, response.body)
        end()
    except errors.StopReached:
        pass  # a stop string across a checkpoint: the text ends there, as one run would have
    except errors.GenerationError:
        raise
    except Exception as exc:  # classified in one place
        raise taxonomy.from_exception(exc) from exc
    if progress.finish_reason is None:
        raise errors.StreamError(
            "the stream ended without a finish_reason" if streamed else "the answer has no finish_reason"
        )
    if progress.finish_reason == "abort":
        raise errors.StreamError("the server aborted the request (finish_reason: abort)")
    return progress


def _fill(p: Progress, answer: dict[str, Any], now: float) -> None:
    """``p`` as the stream of ``answer`` (a ``chat.completion``) would have left it."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    for name in ("content", "reasoning"):
        text = message.get("reasoning_content" if name == "reasoning" else "content")
        if text:
            getattr(p, name).append(text)
    p.tool_calls = [
        {"id": c.get("id"), "type": "function", "function": {**c["function"]}}
        for c in message.get("tool_calls") or ()
    ] or None
    p.logprobs = (choice.get("logprobs") or {}).get("content")
    p.output_ids = choice.get("response_token_ids")
    p.finish_reason, p.matched_stop = choice.get("finish_reason"), choice.get("matched_stop")
    p.usage, p.model = answer.get("usage"), answer.get("model")
    p.chunks = 1
    p.first_chunk_at = p.last_chunk_at = now


@dataclass(slots=True, eq=False)
class _Lines:
    """The body of a stream, as it arrives: split into lines, each ``data:`` line parsed."""

    progress: Progress
    loop: asyncio.AbstractEventLoop
    on_line: LineHandler
    buf: bytes = b""

    def feed(self, data: bytes) -> None:
        if b"\n" not in data:
            self.buf += data
            return
        *lines, self.buf = (self.buf + data).split(b"\n") if self.buf else data.split(b"\n")
        on_line = self.on_line
        for line in lines:
            if line.startswith(_DATA):
                on_line(line[6:], self.progress, self.loop)

    def end(self) -> None:
        if self.buf.startswith(_DATA):
            self.on_line(self.buf[6:], self.progress, self.loop)
        self.buf = b""


def handler_for(request: dict[str, Any], progress: Progress) -> LineHandler:
    """The plain per-line path, or the full one for a request that asks for tool calls,
    log-probabilities or token ids, or whose continuation guards its stop strings."""
    if progress.guard is not None or any(request.get(k) for k in ("tools", "logprobs", SGLEXT_OUTPUT_IDS)):
        return _on_line_full
    return _on_line


def _on_line(payload: bytes, p: Progress, loop: asyncio.AbstractEventLoop, full: bool = False) -> None:
    """One ``data:`` line into ``p``; ``full`` (:data:`_on_line_full`) for the requests that need
    more of each chunk: tool-call fragments assembled by index, log-probabilities appended, the
    token ids of SGLang's ``sglext`` chunk, and a stop string that straddles a checkpoint."""
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
            if full and (calls := delta.get("tool_calls")):
                _add_tool_calls(p, calls)
                p.chunks += 1
        if full and (logprobs := choice.get("logprobs")) and logprobs.get("content"):
            if p.logprobs is None:
                p.logprobs = []
            p.logprobs.extend(logprobs["content"])
        reason = choice.get("finish_reason")
        if reason:
            p.finish_reason = reason
            p.matched_stop = choice.get("matched_stop")
        p.last_chunk_at = loop.time()
        if not p.first_chunk_at:
            p.first_chunk_at = p.last_chunk_at
            p.model = obj.get("model")
            if p.on_first is not None:
                p.on_first()
    elif "error" in obj:
        raise taxonomy.from_error_chunk(obj)
    elif full and (ext := obj.get("sglext")) and ext.get("output_ids"):
        p.output_ids = list(ext["output_ids"][0])
    usage = obj.get("usage")
    if usage:
        p.usage = usage
    if full and p.guard is not None and choices:
        p.guard.check(p)


_on_line_full: LineHandler = functools.partial(_on_line, full=True)


def _add_tool_calls(p: Progress, fragments: list[dict[str, Any]]) -> None:
    """Fold streamed tool-call fragments into whole calls: the first fragment of an ``index``
    carries its id and function name, later ones more of its arguments."""
    if p.tool_calls is None:
        p.tool_calls = []
    calls = p.tool_calls
    for frag in fragments:
        index = frag.get("index") or 0
        while len(calls) <= index:
            calls.append({"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
        call = calls[index]
        if frag.get("id"):
            call["id"] = frag["id"]
        fn = frag.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] = fn["name"]
        args = fn.get("arguments")
        if args:
            call["function"]["arguments"] += args if isinstance(args, str) else orjson.dumps(args).decode()


@dataclass(slots=True)
class StopGuard:
    """A continued job's stop strings, checked across the checkpoint.

    SGLang looks for stop strings in what it generates; a continuation's prompt ends with the
    checkpoint, so a stop string that began in the checkpoint and ends in the continuation is
    not seen, and the text would run past it. The guard looks at the checkpoint's tail and the
    first characters the continuation adds to the same part (content, or reasoning when the
    checkpoint ended inside it): a match there must start in the tail. It ends the stream, as
    one uninterrupted run would have ended; the text is cut with every other job's
    (:func:`tokenmill.outputs.cut_at_stop`).
    """

    tail: str  # the checkpoint's last (longest stop - 1) characters of ``part``
    part: str  # "content" or "reasoning"
    stops: tuple[str, ...]
    longest: int

    @classmethod
    def of(cls, content: str, reasoning: str, stops: tuple[str, ...]) -> StopGuard | None:
        longest = max((len(s) for s in stops), default=0)
        part, text = ("content", content) if content else ("reasoning", reasoning)
        if longest < 2 or not text:
            return None  # a one-character stop string cannot straddle
        return cls(text[-(longest - 1) :], part, stops, longest)

    def check(self, p: Progress) -> None:
        pieces: list[str] = getattr(p, self.part)
        if not pieces:
            return
        new = "".join(pieces)
        window = self.tail + new[: self.longest - 1]
        if any(0 <= window.find(s) < len(self.tail) for s in self.stops):
            p.finish_reason, p.guard = "stop", None  # (which one is decided when the text is cut)
            raise errors.StopReached
        if len(new) >= self.longest - 1:
            p.guard = None  # past the window: any later stop string is SGLang's to find
