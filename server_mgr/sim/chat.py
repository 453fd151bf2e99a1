"""``POST /v1/chat/completions``: plan the request, hand it to the scheduler, stream its tokens.

The request-level fault knobs live here: ``--sim-error-every`` (an error chunk after a few
tokens), ``--sim-stall-every`` (silence after a few tokens until the client leaves) and
``--sim-crash-after-requests``. A client that disconnects aborts its request (aiohttp cancels
the handler; the ``finally`` frees its KV tokens).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

from server_mgr.sim import faults, sse
from server_mgr.sim.scheduler import QueueFullError, SimRequest
from server_mgr.sim.state import STATE, SimState
from server_mgr.sim.validation import ChatPlan, RequestError, plan_chat

FAULT_AFTER_TOKENS = 3
QUEUE_FULL = "The request queue is full."


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The JSON body of an OpenAI route, refused as SGLang refuses it (400, not 415/422)."""
    if request.content_type != "application/json":
        raise RequestError("Unsupported Media Type: Only 'application/json' is allowed", type_="Bad Request")
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"JSON decode error: {exc}", type_="Bad Request") from None
    if not isinstance(body, dict):
        raise RequestError("Input should be a valid dictionary", type_="Bad Request")
    return body


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """The chat endpoint (§3)."""
    state = request.app[STATE]
    cfg = state.cfg
    state.chat_requests += 1
    n = state.chat_requests
    if cfg.crash_after_requests and n >= cfg.crash_after_requests:
        faults.crash(state.log)
    try:
        plan = plan_chat(await read_json(request), cfg, state.log)
    except RequestError as exc:
        return json_response(exc.body(), exc.status)
    fault = None
    if cfg.error_every and n % cfg.error_every == 0:
        fault = "error"
    elif cfg.stall_every and n % cfg.stall_every == 0:
        fault = "stall"
    c = plan.completion
    req = SimRequest(
        rid=plan.rid,
        prompt_tokens=c.prompt_tokens,
        output_tokens=c.completion_tokens,
        max_new_tokens=plan.max_new_tokens,
        finish_reason=c.finish_reason,
    )
    try:
        state.scheduler.submit(req)
    except QueueFullError:
        return await _queue_full(request, plan)
    state.inflight[req.rid] = req
    try:
        if plan.stream:
            return await _stream(request, state, plan, req, fault)
        return await _whole(state, plan, req, fault)
    finally:
        state.inflight.pop(req.rid, None)
        if not req.finished:
            state.scheduler.finish(req, "abort")
        state.record_finish(req)


async def _queue_full(request: web.Request, plan: ChatPlan) -> web.StreamResponse:
    """§4.3: 503 for a plain request; for a stream, HTTP 200, an error event, ``[DONE]``."""
    if not plan.stream:
        err = RequestError(QUEUE_FULL, status=503, type_="503")
        return json_response(err.body(), 503)
    resp = await _open_stream(request)
    await resp.write(sse.error_chunk(QUEUE_FULL, "SERVICE_UNAVAILABLE", 503) + sse.DONE)
    return resp


async def _open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    # uvicorn logs a stream's access line when its headers go out, not when it ends
    request.app[STATE].log.access(peer(request), request.method, request.path_qs, 200, "OK")
    request["access_logged"] = True
    return resp


def peer(request: web.Request) -> str:
    """``host:port`` of the client, for access lines."""
    addr = request.transport.get_extra_info("peername") if request.transport else None
    return f"{addr[0]}:{addr[1]}" if addr else "unknown"


async def _stream(
    request: web.Request, state: SimState, plan: ChatPlan, req: SimRequest, fault: str | None
) -> web.StreamResponse:
    c = plan.completion
    tokens, split = c.tokens, c.reasoning_tokens
    enc = sse.ChunkEncoder(plan.rid, int(time.time()), plan.model)
    resp = await _open_stream(request)
    await resp.write(enc.role())
    sent = 0
    while True:
        upto = req.emitted
        if fault and (upto >= FAULT_AFTER_TOKENS or req.finished):
            return await _stream_fault(state, plan, req, resp, enc, fault, sent)
        if upto > sent:
            buf = b""
            if sent < split:
                done = min(upto, split)
                buf = enc.reasoning("".join(tokens[sent:done]), _usage(plan, req, done, split))
            if upto > split:
                buf += enc.content("".join(tokens[max(sent, split) : upto]), _usage(plan, req, upto, split))
            await resp.write(buf)
            sent = upto
        elif req.finished:
            break
        else:
            await req.wait()
    tail = enc.finish(req.finish_reason)
    if plan.include_usage:
        tail += enc.usage(req.prompt_tokens, req.generated, min(req.generated, split))
    await resp.write(tail + sse.DONE)
    return resp


def _usage(plan: ChatPlan, req: SimRequest, generated: int, split: int) -> bytes:
    """The running usage a chunk carries with ``continuous_usage_stats`` (else nothing)."""
    if not plan.continuous_usage:
        return b""
    return orjson.dumps(sse.usage_body(req.prompt_tokens, generated, min(generated, split)))


async def _stream_fault(
    state: SimState,
    plan: ChatPlan,
    req: SimRequest,
    resp: web.StreamResponse,
    enc: sse.ChunkEncoder,
    fault: str,
    sent: int,
) -> web.StreamResponse:
    """Cut the stream after ``sent`` tokens: an error event (§3.5), or silence until abandoned."""
    state.scheduler.finish(req, "abort")
    req.generated = sent
    if fault == "stall":
        await asyncio.Event().wait()  # until the client disconnects and aiohttp cancels us
    buf = sse.error_chunk(QUEUE_FULL, "SERVICE_UNAVAILABLE", 503)
    if plan.include_usage:
        buf += enc.usage(req.prompt_tokens, sent, min(sent, plan.completion.reasoning_tokens))
    await resp.write(buf + sse.DONE)
    return resp


async def _whole(state: SimState, plan: ChatPlan, req: SimRequest, fault: str | None) -> web.StreamResponse:
    while not req.finished:
        if fault and req.emitted >= FAULT_AFTER_TOKENS:
            state.scheduler.finish(req, "abort")
            if fault == "stall":
                await asyncio.Event().wait()
            err = RequestError(QUEUE_FULL, status=503, type_="503")
            return json_response(err.body(), 503)
        await req.wait()
    c = plan.completion
    n = req.generated
    n_reason = min(n, c.reasoning_tokens)
    body = sse.chat_response(
        rid=plan.rid,
        created=int(time.time()),
        model=plan.model,
        reasoning_content="".join(c.tokens[:n_reason]),
        content="".join(c.tokens[n_reason:n]),
        finish_reason=req.finish_reason,
        prompt_tokens=req.prompt_tokens,
        completion_tokens=n,
        reasoning_tokens=n_reason,
    )
    return web.Response(body=body, content_type="application/json")
