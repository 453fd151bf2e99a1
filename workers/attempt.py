"""One attempt at a job on the worker's event loop: stream, watch, checkpoint.

The stream runs as a task; beside it a watchdog wakes about once a second to enforce the
request's deadlines (first token, stall, total), renew the lease, and checkpoint the partial
text every N tokens or S seconds. The per-chunk path therefore never touches Redis. The
heartbeat's reply also carries ``cancel --now``: the watchdog then stops the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from openai import AsyncOpenAI

from tokenmill import errors
from tokenmill.ledger import CANCEL_NOW, AsyncHeartbeat, Checkpoint, Claim, SlotUpdate
from tokenmill.settings import Settings
from workers.stream import Progress, stream_chat

WATCH_PERIOD_S = 1.0
log = logging.getLogger("tokenmill.worker")


@dataclass(slots=True)
class Outcome:
    """A finished attempt: the result to commit and the tokens not yet counted."""

    result: dict[str, Any]
    new_tokens: int


@dataclass(slots=True)
class AttemptState:
    """Shared between the stream and the watchdog; also what a release checkpoints."""

    base: Checkpoint
    progress: Progress
    reported_tokens: int = 0
    # generated tokens -> the admission slot's new size and the length bins reached
    slot_update: Callable[[int], SlotUpdate] | None = None

    def checkpoint(self) -> Checkpoint:
        p = self.progress
        return Checkpoint(
            content=self.base.content + "".join(p.content),
            reasoning=self.base.reasoning + "".join(p.reasoning),
            tokens=self.base.tokens + p.tokens,
            prompt_tokens=self.prompt_tokens(),
        )

    def prompt_tokens(self) -> int:
        """The original prompt's size. A continuation's prompt also holds the partial, whose
        tokens need not be the ones generated (the text is tokenized again), so the size seen
        by the first attempt travels with the checkpoint; an older checkpoint without it falls
        back to the continuation's prompt less the partial's generated tokens."""
        seen = int((self.progress.usage or {}).get("prompt_tokens") or 0)
        if not self.base:
            return seen
        return self.base.prompt_tokens or max(0, seen - self.base.tokens)


def build_request(
    claim: Claim, settings: Settings, base: Checkpoint
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat request for this attempt, continuing from ``base`` when it is non-empty."""
    req = claim.spec["request"]
    messages = list(req["messages"])
    extra: dict[str, Any] = {"rid": f"{claim.run}/{claim.job_id}/{claim.attempt}"}
    max_tokens = req.get("max_tokens")
    if base:
        messages.append({"role": "assistant", "content": continuation_text(base, settings.think_end_tag)})
        extra["continue_final_message"] = True
        if max_tokens is not None:
            max_tokens -= base.tokens
    request: dict[str, Any] = {"model": req.get("model") or settings.model, "messages": messages}
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "seed"):
        if req.get(name) is not None:
            request[name] = req[name]
    return request, extra


def continuation_text(base: Checkpoint, think_end_tag: str) -> str:
    """The final assistant message that continues ``base``: the model's raw text so far.

    SGLang (0.5.23) continues only a final message's ``content``: it renders the earlier messages
    with the generation prompt and appends that text, and the final message's
    ``reasoning_content`` is dropped. Its reasoning parser then reads the text: once it holds the
    think-end tag, what follows is content, else reasoning. So a partial inside the reasoning is
    sent as the reasoning text, and one past it as reasoning, the tag, then the content; this
    fits chat templates whose generation prompt opens the think block (DeepSeek-R1-0528,
    Qwen3 thinking), where the model never writes the opening tag itself.
    """
    if not base.reasoning:
        return base.content
    return base.reasoning + (think_end_tag + base.content if base.content else "")


async def run_attempt(
    client: AsyncOpenAI,
    claim: Claim,
    settings: Settings,
    heartbeat: AsyncHeartbeat,
    state: AttemptState,
    stopping: threading.Event,
) -> Outcome:
    """Stream the job to completion under the watchdog; raise a classified error otherwise."""
    request, extra = build_request(claim, settings, state.base)
    if request.get("max_tokens") is not None and request["max_tokens"] <= 0:
        return await _ended_at_the_limit(client, claim, settings, request, extra, state)
    loop = asyncio.get_running_loop()
    started = loop.time()
    stream = asyncio.ensure_future(stream_chat(client, request, extra, state.progress))
    watch = asyncio.ensure_future(_watchdog(stream, claim, settings, heartbeat, state, started, stopping))
    try:
        await stream
    except asyncio.CancelledError:
        if watch.done() and watch.exception() is not None:
            raise watch.exception() from None  # type: ignore[misc]
        raise
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError, errors.TokenmillError):
            await watch
    return _outcome(claim, request, state, state.progress.finish_reason or "stop", started)


async def _ended_at_the_limit(
    client: AsyncOpenAI,
    claim: Claim,
    s: Settings,
    request: dict[str, Any],
    extra: dict[str, Any],
    state: AttemptState,
) -> Outcome:
    """The checkpoint already holds every token max_tokens allows (the worker died between its
    last checkpoint and the commit). Ask the server for one more token, only to learn whether the
    text had ended by itself (``stop``) or was cut (``length``) and how long the prompt is; the
    probe's token is not kept."""
    probe = Progress()
    try:
        await asyncio.wait_for(
            stream_chat(client, {**request, "max_tokens": 1}, extra, probe),
            s.connect_timeout_s + s.stall_timeout_s,
        )
    except TimeoutError:
        raise errors.StreamStalledError(
            f"the end-of-text probe got no answer within {s.connect_timeout_s + s.stall_timeout_s:.0f}s"
        ) from None
    ended = probe.finish_reason == "stop" and not "".join(probe.content + probe.reasoning)
    usage = probe.usage or {}
    state.progress.usage = {"prompt_tokens": int(usage.get("prompt_tokens") or 0), "completion_tokens": 0}
    state.progress.model = probe.model
    return _outcome(claim, request, state, "stop" if ended else "length", 0.0)


async def _watchdog(
    stream: asyncio.Future[Any],
    claim: Claim,
    s: Settings,
    heartbeat: AsyncHeartbeat,
    state: AttemptState,
    started: float,
    stopping: threading.Event,
) -> None:
    loop = asyncio.get_running_loop()
    p = state.progress
    last_renew = last_ckpt_at = started
    last_ckpt_tokens = 0
    renew_every = s.lease_ttl_s / 3
    while not stream.done():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(stream), WATCH_PERIOD_S)
        if stream.done():
            return
        now = loop.time()
        problem = _deadline_problem(s, p, now, started, stopping)
        if problem is not None:
            stream.cancel()
            raise problem
        tokens = p.tokens
        due_ckpt = tokens > last_ckpt_tokens and (
            tokens - last_ckpt_tokens >= s.checkpoint_every_tokens
            or now - last_ckpt_at >= s.checkpoint_every_s
        )
        if due_ckpt or now - last_renew >= renew_every:
            ck = state.checkpoint() if due_ckpt else None
            total = state.base.tokens + tokens
            new = max(0, total - state.base.tokens - state.reported_tokens)
            try:
                held = state.slot_update(total) if state.slot_update else None
                reply = await heartbeat(claim, s.lease_ttl_s, ck, new, held)
            except redis.RedisError as exc:
                # Redis is restarting or paused: keep streaming; the next tick tries again.
                log.warning("job %s: heartbeat failed (%s); will retry", claim.job_id, exc)
                continue
            if not reply:
                stream.cancel()
                raise errors.StaleClaimError(f"job {claim.job_id}: the lease was taken over")
            state.reported_tokens += new
            last_renew = now
            if due_ckpt:
                last_ckpt_at, last_ckpt_tokens = now, tokens
            if reply == CANCEL_NOW:
                stream.cancel()
                raise errors.JobCancelledError("cancelled (cancel --now); checkpointed")


def _deadline_problem(
    s: Settings, p: Progress, now: float, started: float, stopping: threading.Event
) -> errors.GenerationError | None:
    if stopping.is_set():
        return errors.ShutdownError("the worker is shutting down; checkpointed and released")
    if now - started > s.total_timeout_s:
        return errors.RequestTimeoutError(f"the request ran past total_timeout_s={s.total_timeout_s}")
    if not p.first_chunk_at:
        if now - started > s.first_token_timeout_s:
            return errors.StreamStalledError(
                f"no first token within first_token_timeout_s={s.first_token_timeout_s}"
            )
    elif now - p.last_chunk_at > s.stall_timeout_s:
        return errors.StreamStalledError(f"no chunk for stall_timeout_s={s.stall_timeout_s}")
    return None


def _outcome(
    claim: Claim, request: dict[str, Any], state: AttemptState, finish: str, started: float
) -> Outcome:
    p = state.progress
    ck = state.checkpoint()
    new_completion = p.tokens
    prompt_tokens = state.prompt_tokens()
    ttft = (p.first_chunk_at - started) if p.first_chunk_at and started else None
    decode_s = (p.last_chunk_at - p.first_chunk_at) if p.first_chunk_at else 0.0
    result = {
        "content": ck.content,
        "reasoning_content": ck.reasoning or None,
        "finish_reason": finish,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": state.base.tokens + new_completion},
        "model": p.model or request["model"],
        "attempt": claim.attempt,
        "continued_tokens": state.base.tokens,
        "ttft_s": round(ttft, 4) if ttft is not None else None,
        "decode_tps": round(p.tokens / decode_s, 2) if decode_s > 0 else None,
    }
    new_tokens = max(0, new_completion - state.reported_tokens)
    return Outcome(result=result, new_tokens=new_tokens)
