"""One attempt at a job on the worker's event loop: build the request, stream it under the
process's watch (:mod:`workers.watch`: deadlines, lease, checkpoints), and shape the result;
then what its commit sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tokenmill import errors, outputs, quality
from tokenmill.options import SGLEXT_OUTPUT_IDS, STOPS, answered_whole, restart_reason, stop_strings
from tokenmill.settings import Settings
from tokenmill.transitions import Checkpoint, Claim, Judged, LengthReport
from tokenmill.url_secrets import redact_url
from workers.admission.limiter import LengthTracker, Slot
from workers.stream import Progress, StopGuard, StreamClient, stream_chat, whole_chat
from workers.watch import AttemptState, Watch

if TYPE_CHECKING:
    from workers.runtime import Runtime

log = logging.getLogger("tokenmill.worker")


class Commit(NamedTuple):
    """What a commit sends (:func:`tokenmill.transitions.commit`'s arguments after the claim)."""

    result: dict[str, Any]
    new_tokens: int
    lengths: LengthReport | None
    judged: Judged | None  # the job's quality flags (None: not judged)


@dataclass(slots=True)
class Attempted:
    """A claimed job after its attempt: its outcome, or the error the attempt ended with."""

    claim: Claim
    slot: Slot
    url: str
    state: AttemptState
    tracker: LengthTracker | None
    outcome: Commit | None = None  # its result and the tokens not yet counted (nothing judged)
    error: errors.GenerationError | errors.StaleClaimError | None = None

    def commit(self, settings: Settings, bounds: quality.LengthBounds | None = None) -> Commit:
        """The commit of this attempt's outcome, its quality judged (``bounds``: the run's usual
        completion lengths, if known). Build it once and send that: the length bins it reports
        are taken from the tracker."""
        assert self.outcome is not None
        result = self.outcome.result
        result["server"] = redact_url(self.url)
        if self.claim.checkpoint.tokens and not self.state.base:
            # a checkpoint existed and was not continued (continue_partial off, the request's
            # options forbid it: tokenmill.options.restart_reason, or its tokens were not the
            # server's count: uncounted): its tokens are thrown away
            result["restarted"] = True
            result["discarded_tokens"] = self.claim.checkpoint.tokens
        lengths = None
        if self.tracker:
            lengths = self.tracker.finish(result["usage"]["completion_tokens"], self.state.progress.usage)
        judged = judge(result, self.claim, settings, bounds)
        return Commit(result, self.outcome.new_tokens, lengths, judged)


def judge(
    result: dict[str, Any], claim: Claim, settings: Settings, bounds: quality.LengthBounds | None
) -> Judged | None:
    """The job's quality flags for its commit (:func:`tokenmill.quality.flags`); None when
    judging is off, or failed (a judge's fault never costs a job its commit)."""
    if not settings.quality_signals:
        return None
    try:
        mask = quality.flags(result, claim.spec["request"], bounds)
    except Exception:
        log.exception("job %s/%s: quality not judged", claim.run, claim.job_id)
        return None
    return Judged(mask, settings.quality_window_jobs)


def uncounted(base: Checkpoint) -> str | None:
    """Why a checkpoint whose size the server never stated cannot be continued (None: it can).

    A stream's chunks carry the server's running usage (``continuous_usage_stats``), and a
    checkpoint counts its tokens by it; a hop that forwards usage only on the last chunk
    (sglang-router 0.3.2 in front of SGLang 0.5.23: seen) leaves the attempt counting chunks, and
    a chunk may hold several tokens (``--stream-interval``, a character split across tokens). A
    continuation asks for ``max_tokens`` less the checkpoint's tokens, so a miscounted checkpoint
    would make the row longer or shorter than an uninterrupted one; and the original prompt's
    size, which a continued row reports, was never seen. Such a checkpoint's first attempt saw
    no prompt size: the job starts over instead."""
    if base.prompt_tokens:
        return None
    return "the server never stated its token count (no usage on the stream's chunks)"


async def attempt_job(
    rt: Runtime, claim: Claim, url: str, slot: Slot, on_first: Callable[[], None]
) -> Attempted:
    """Stream a claimed job on the worker's loop; an error is returned in the result, for the
    task's thread to settle (it may have to wait for Redis). ``on_first`` is called at the
    stream's first chunk."""
    s = rt.settings
    base = claim.checkpoint if s.continue_partial else Checkpoint()
    why = (restart_reason(claim.spec["request"]) or uncounted(base)) if base.tokens else None
    if why is not None:
        log.info("job %s: starting over (%d tokens thrown away): %s", claim.job_id, base.tokens, why)
    if why is not None or not base:  # a checkpoint without text (tool calls) is no base either
        base = Checkpoint()
    state = AttemptState(base=base, progress=Progress(on_first=on_first))
    tracker = None
    if slot.tokens:
        tracker = rt.admission.tracker(claim.run, claim.spec["request"], base.tokens, slot.shared)
        state.slot_update = tracker.update
    else:
        claim.slot = None
    done = Attempted(claim, slot, url, state, tracker)
    client = rt.client(url)
    try:
        try:
            done.outcome = await run_attempt(client, claim, s, rt.watch, state)
        except errors.InvalidRequestError as exc:
            if not state.base:
                raise
            # The server refused to continue the partial: start over, and record that it did.
            log.warning("job %s: continuation refused (%s); starting over", claim.job_id, exc.message)
            state.base, state.progress, state.reported_tokens = Checkpoint(), Progress(on_first=on_first), 0
            done.outcome = await run_attempt(client, claim, s, rt.watch, state)
    except (errors.GenerationError, errors.StaleClaimError) as exc:
        done.error = exc
    return done


# Fields of the stored request that the attempt sets itself rather than copying.
_SET_HERE = frozenset(("model", "messages", "max_tokens", "min_tokens"))


def build_request(
    claim: Claim, settings: Settings, base: Checkpoint
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat request for this attempt, continuing from ``base`` when it is non-empty: the
    job's request options as enqueued, with its token counts less what ``base`` holds."""
    req = claim.spec["request"]
    messages = list(req["messages"])
    extra: dict[str, Any] = {"rid": f"{claim.run}/{claim.job_id}/{claim.attempt}"}
    max_tokens, min_tokens = req.get("max_tokens"), req.get("min_tokens")
    if base:
        messages.append({"role": "assistant", "content": continuation_text(base, settings.think_end_tag)})
        extra["continue_final_message"] = True
        if max_tokens is not None:
            max_tokens -= base.tokens
        if min_tokens:
            min_tokens = max(0, min_tokens - base.tokens)
    request: dict[str, Any] = {"model": req.get("model") or settings.model, "messages": messages}
    request.update((k, v) for k, v in req.items() if k not in _SET_HERE)
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    if min_tokens:
        request["min_tokens"] = min_tokens
    if req.get("return_token_ids") and not answered_whole(req):
        # SGLang refuses return_token_ids on a stream; the same ids come in its sglext chunk
        del request["return_token_ids"]
        request[SGLEXT_OUTPUT_IDS] = True
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
    client: StreamClient, claim: Claim, settings: Settings, watch: Watch, state: AttemptState
) -> Commit:
    """Stream the job to completion under the watch; raise a classified error otherwise."""
    request, extra = build_request(claim, settings, state.base)
    if request.get("max_tokens") is not None and request["max_tokens"] <= 0:
        return await _ended_at_the_limit(client, claim, settings, request, extra, state)
    if state.base and request.get("stop"):
        state.progress.guard = StopGuard.of(state.base.content, state.base.reasoning, stop_strings(request))
    loop = asyncio.get_running_loop()
    started = loop.time()
    state.progress.whole = answered_whole(request)
    send = whole_chat if state.progress.whole else stream_chat
    stream = asyncio.ensure_future(send(client, request, extra, state.progress))
    watched = watch.add(claim, state, stream, started, client.server)
    try:
        await stream
    except asyncio.CancelledError:
        if watched.error is not None:  # the watch cut the stream: say why
            raise watched.error from None
        raise
    finally:
        await watch.drop(watched)
    return _outcome(claim, request, state, state.progress.finish_reason or "stop", started)


async def _ended_at_the_limit(
    client: StreamClient,
    claim: Claim,
    s: Settings,
    request: dict[str, Any],
    extra: dict[str, Any],
    state: AttemptState,
) -> Commit:
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


def _outcome(
    claim: Claim, request: dict[str, Any], state: AttemptState, finish: str, started: float
) -> Commit:
    p = state.progress
    req = claim.spec["request"]
    ck = state.checkpoint()
    cut = outputs.cut_at_stop(ck.content, ck.reasoning, stop_strings(req), bool(req.get("no_stop_trim")))
    matched = p.matched_stop if cut.stop is None else cut.stop
    if cut.stop is not None and finish != "tool_calls":  # (tool calls are left as they came)
        finish = "stop"
    new_completion = p.tokens
    prompt_tokens = state.prompt_tokens()
    ttft = (p.first_chunk_at - started) if p.first_chunk_at and started else None
    decode_s = (p.last_chunk_at - p.first_chunk_at) if p.first_chunk_at else 0.0
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": state.base.tokens + new_completion}
    # the server counts a continuation's own tokens only: its reasoning count is not the job's
    reasoning = None if state.base else outputs.reasoning_tokens(p.usage)
    if reasoning is not None:
        usage["reasoning_tokens"] = reasoning
    result: dict[str, Any] = {
        "content": cut.content,
        "reasoning_content": cut.reasoning or None,
        "finish_reason": finish,
        "usage": usage,
        "model": p.model or request["model"],
        "attempt": claim.attempt,
        "continued_tokens": state.base.tokens,
        "ttft_s": round(ttft, 4) if ttft is not None else None,
        "decode_tps": round(p.tokens / decode_s, 2) if decode_s > 0 else None,
    }
    if matched is not None and any(req.get(name) for name in STOPS):
        result["matched_stop"] = matched  # (without stop options it is the EOS token's id)
    _per_token_data(req, p, result)
    if cut.stop is not None and cut.content != ck.content and not ck.reasoning:
        end = len(cut.content) + (0 if req.get("no_stop_trim") else len(cut.stop))
        _cut_per_token(result, ck.content, end)
    return Commit(result, max(0, new_completion - state.reported_tokens), None, None)


def _cut_per_token(result: dict[str, Any], text: str, end: int) -> None:
    """The log-probabilities, token ids and completion tokens of ``result`` cut where its
    ``text`` was cut at a stop string (``end``: where the stop string ends, the token that
    completed it kept and counted, as SGLang counts it), when the log-probabilities' token texts
    spell ``text``; otherwise (no log-probabilities, or special tokens or split characters in
    them) they stay as the server sent them."""
    entries = (result.get("logprobs") or {}).get("content")
    if not entries or (n := outputs.tokens_through([e["token"] for e in entries], text, end)) is None:
        return
    result["logprobs"]["content"] = entries[:n]
    if "output_token_ids" in result:
        result["output_token_ids"] = result["output_token_ids"][:n]
    result["usage"]["completion_tokens"] = n


def _per_token_data(req: dict[str, Any], p: Progress, result: dict[str, Any]) -> None:
    """Tool calls, log-probabilities and token ids into ``result``; a list that does not cover
    every generated token is an error, never a short row (such jobs are never continued, so
    the attempt's tokens are all the job's)."""
    # An answer cut by max_tokens keeps no tool call: SGLang's whole answer drops a call whose
    # closing marker did not come (even when its arguments parse), and a stream sends a call's
    # name and argument pieces without saying whether that marker came.
    if p.tool_calls and p.finish_reason != "length":
        result["tool_calls"] = p.tool_calls
    tokens = p.tokens
    if req.get("logprobs"):
        got = len(p.logprobs or ())
        if got != tokens:
            raise errors.IncompleteOutputError(f"the server sent {got} log-probabilities for {tokens} tokens")
        result["logprobs"] = {"content": p.logprobs or []}
    if req.get("return_token_ids"):
        if p.output_ids is None:
            raise errors.UnsupportedOptionError(
                "the server sent no token ids: return_token_ids needs SGLang >= 0.5.23 (its sglext "
                "output_ids on a stream)"
            )
        if len(p.output_ids) != tokens:
            raise errors.IncompleteOutputError(
                f"the server sent {len(p.output_ids)} token ids for {tokens} tokens"
            )
        result["output_token_ids"] = p.output_ids
