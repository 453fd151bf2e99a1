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

from server_mgr.sim import faults, render, sse
from server_mgr.sim.errors import RequestError
from server_mgr.sim.scheduler import QueueFullError, SimRequest
from server_mgr.sim.state import STATE, SimState
from server_mgr.sim.validation import ChatPlan, plan_chat

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
        body = await read_json(request)
        if state.faults.ignore_stop:  # the fault: the output neither ends nor is cut at them
            body.pop("stop", None)
        plan = plan_chat(body, cfg, state.log, state.faults.degrade)
    except RequestError as exc:
        return json_response(exc.body(), exc.status)
    fault = None
    if cfg.error_every and n % cfg.error_every == 0:
        fault = "error"
    elif cfg.stall_every and n % cfg.stall_every == 0:
        fault = "stall"
    out = plan.output
    req = SimRequest(
        rid=plan.rid,
        prompt_tokens=out.prompt_tokens,
        output_tokens=0 if plan.abort else len(out.tokens),
        max_new_tokens=plan.max_new_tokens,
        finish_reason="abort" if plan.abort else out.finish_reason,
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
    enc = sse.ChunkEncoder(plan.rid, int(time.time()), plan.model)
    if plan.abort:
        return await _stream_abort(request, plan, req)
    resp = await _open_stream(request)
    # SGLang sends the role chunk with the first output, after the prefill (serving_chat's
    # `async for content in generate_request(...)`): a client may take it as "prompt cached"
    while not req.emitted and not req.finished:
        await req.wait()
    await resp.write(enc.role())
    renderer = render.StreamRenderer(plan, enc)
    sent = 0
    while True:
        upto = req.emitted
        if fault and (upto >= FAULT_AFTER_TOKENS or req.finished):
            return await _stream_fault(state, plan, req, resp, enc, fault, sent)
        if req.finished:
            await resp.write(renderer.step(req.generated, req.finish_reason != "abort"))
            break
        if upto > sent:
            await resp.write(renderer.step(upto, False))
            sent = upto
        else:
            await req.wait()
    tail = renderer.finish(req.finish_reason)
    if plan.opts.output_ids_in_sglext:
        tail += enc.sglext([plan.output.ids()[: req.generated]])
    if plan.include_usage:
        tail += enc.usage(req.prompt_tokens, req.generated, _reasoning_tokens(plan, req.generated))
    await resp.write(tail + sse.DONE)
    return resp


def _reasoning_tokens(plan: ChatPlan, generated: int) -> int:
    return min(generated, plan.output.reasoning_tokens) if plan.reasoning else 0


async def _stream_abort(request: web.Request, plan: ChatPlan, req: SimRequest) -> web.StreamResponse:
    """A grammar that does not compile: SGLang's scheduler aborts the request with 400, which a
    stream gets as HTTP 200, an error event (type ``BAD_REQUEST``), the usage chunk when asked
    (SGLang reports 1 prompt and 1 completion token for it) and ``[DONE]``; no role chunk."""
    while not req.finished:
        await req.wait()
    resp = await _open_stream(request)
    buf = sse.error_chunk(plan.abort or "", "BAD_REQUEST", 400)
    if plan.include_usage:
        buf += sse.ChunkEncoder(plan.rid, int(time.time()), plan.model).usage(1, 1, 0)
    await resp.write(buf + sse.DONE)
    return resp


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
        buf += enc.usage(req.prompt_tokens, sent, _reasoning_tokens(plan, sent))
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
    if plan.abort:
        err = RequestError(plan.abort, type_="BadRequestError")
        return json_response(err.body(), err.status)
    body = render.whole(plan, req.generated, req.finish_reason)
    return web.Response(body=body, content_type="application/json")
