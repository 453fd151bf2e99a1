"""A request's output as SGLang 0.5.23's chat endpoint shows it: SSE chunks step by step, or one
``chat.completion`` body.

Streaming (``serving_chat._generate_chat_stream``): the scheduler sends a step unless the text so
far ends with the start of a stop string (it is held back and goes out with a later step); a
step's log-probabilities ride on its first chunk (reasoning, then content); with no parser on the
server, a step whose text is empty sends no chunk and its log-probabilities are lost, as in
SGLang; with a parser, they go out in a chunk of their own. With tool-call parsing, the content
goes through the parser (:class:`toolcalls.CallStreamer`) and comes out as SGLang's pydantic-built
chunks. The finish chunk says ``tool_calls`` once a call was streamed (its ``matched_stop`` is
left as it was); the non-streamed response also clears ``matched_stop`` then.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import orjson

from server_mgr.sim import sse, toolcalls
from server_mgr.sim.decode import Output
from server_mgr.sim.validation import ChatPlan


class StreamRenderer:
    """The chunks of one stream, fed the number of tokens the scheduler has emitted."""

    def __init__(self, plan: ChatPlan, enc: sse.ChunkEncoder, out: Output | None = None) -> None:
        self.plan = plan
        self.enc = enc
        self.out = out = out or plan.output  # this choice's output (n > 1: one renderer each)
        self.full = out.full_text
        self.split = out.reasoning_chars if plan.reasoning else 0
        self.sent_tokens = 0  # tokens whose log-probabilities went out
        self.sent_chars = 0
        self.calls = toolcalls.CallStreamer() if plan.tool_parsing else None
        self.tool_calls = False

    def step(self, upto: int, final: bool) -> bytes:
        """Chunks for the output after ``upto`` tokens (``final``: the request has finished)."""
        out = self.out
        shown = out.text_end if final else out.shown_after(upto)
        if shown is None:
            return b""
        logprobs = self._logprobs(upto)
        buf = b""
        if self.sent_chars < self.split:
            text = self.full[self.sent_chars : min(shown, self.split)]
            if text:
                buf += self.enc.reasoning(text, self._usage(upto), logprobs)
                logprobs = b""
        if self.calls is not None:
            content = self.full[self.split : shown] if shown > self.split else ""
            buf += self._tool_step(content, final, upto)
        elif shown > max(self.sent_chars, self.split):
            text = self.full[max(self.sent_chars, self.split) : shown]
            buf += self.enc.content(text, self._usage(upto), logprobs)
            logprobs = b""
        if logprobs and self.plan.parsers:
            buf += self.enc.bare(logprobs, self._usage(upto))
        self.sent_chars = max(self.sent_chars, shown)
        return buf

    def _logprobs(self, upto: int) -> bytes:
        if not self.plan.opts.logprobs or upto <= self.sent_tokens:
            return b""
        entries = self.out.logprobs(self.sent_tokens, upto, self.plan.opts.top_logprobs)
        self.sent_tokens = upto
        return orjson.dumps({"content": entries})

    def _usage(self, upto: int) -> bytes:
        if not self.plan.continuous_usage:
            return b""
        reasoning = min(upto, self.out.reasoning_tokens) if self.plan.reasoning else 0
        return orjson.dumps(sse.usage_body(self.out.prompt_tokens, upto, reasoning))

    def _tool_step(self, content: str, final: bool, upto: int) -> bytes:
        assert self.calls is not None
        normal, deltas = self.calls.feed(content, final)
        usage = orjson.loads(self._usage(upto)) if self.plan.continuous_usage else None
        buf = self.enc.model_chunk({"content": normal}, usage) if normal else b""
        for delta in deltas:
            self.tool_calls = True
            buf += self.enc.model_chunk({"tool_calls": [delta]}, usage)
        return buf

    def finish(self, finish_reason: str) -> bytes:
        reason = "tool_calls" if self.tool_calls and finish_reason == "stop" else finish_reason
        matched = self.out.matched_stop if finish_reason == "stop" else None
        return self.enc.finish(reason, matched)


def whole(plan: ChatPlan, generated: int, finish_reason: str) -> bytes:
    """The non-streamed body of a request that generated ``generated`` tokens (per choice: a
    choice of ``n`` shorter than that finished on its own)."""
    choices, counts, reasoning = [], [], 0
    for index, out in enumerate(plan.outputs):
        made = min(generated, len(out.tokens))
        reason = finish_reason if finish_reason == "abort" or made < len(out.tokens) else out.finish_reason
        choices.append(_choice(plan, out, index, made, reason))
        counts.append(made)
        reasoning += min(made, out.reasoning_tokens) if plan.reasoning else 0
    out = plan.output
    return sse.chat_response(
        rid=plan.rid,
        created=int(time.time()),
        model=plan.model,
        choices=choices,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=sum(counts),
        reasoning_tokens=reasoning,
        sglext={"output_ids": [o.ids()[:c] for o, c in zip(plan.outputs, counts, strict=True)]}
        if plan.opts.output_ids_in_sglext
        else None,
    )


def _choice(plan: ChatPlan, out: Output, index: int, generated: int, finish_reason: str) -> dict[str, Any]:
    done = finish_reason != "abort" and generated == len(out.tokens)
    text = out.text if done else "".join(out.tokens[:generated])
    split = min(out.reasoning_chars, len(text)) if plan.reasoning else 0
    reasoning, content = text[:split], text[split:]
    matched = out.matched_stop if finish_reason == "stop" else None
    message: dict[str, Any] = {"content": content, "reasoning_content": reasoning or None}
    if plan.tool_parsing:
        # SGLang keeps the text before the first call marker, calls or not
        normal, calls = toolcalls.parse(content)
        message = {"content": normal, "reasoning_content": reasoning or None}
        if calls:
            message["tool_calls"] = toolcalls.response_calls(calls)
            if finish_reason == "stop":
                finish_reason, matched = "tool_calls", None
    extra: dict[str, Any] = {}
    if plan.opts.logprobs:
        extra["logprobs"] = {"content": out.logprobs(0, generated, plan.opts.top_logprobs)}
    if plan.opts.return_token_ids:
        extra["prompt_token_ids"] = prompt_ids(plan)
        extra["response_token_ids"] = out.ids()[:generated]
    return sse.response_choice(index, message, extra, finish_reason, matched)


def prompt_ids(plan: ChatPlan) -> list[int]:
    """Made-up prompt token ids, as many as the prompt's tokens, the same for the same rid."""
    digest = hashlib.blake2b(plan.output.key, digest_size=64).digest()
    return [1000 + digest[i % 64] for i in range(plan.output.prompt_tokens)]
