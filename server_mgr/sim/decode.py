"""What one request generates once its options apply: the tokens, where they stop, and why.

:mod:`server_mgr.sim.textgen` draws the free text; this module bends it the way SGLang 0.5.23's
scheduler and detokenizer would:

- an output constraint (``response_format``, ``regex``, ``ebnf``) or a forced tool call
  (``tool_choice`` ``required`` or named; ``auto`` calls a tool for about half the prompts when
  a tool-call parser is set) replaces the content with a string of the grammar, after the
  reasoning when there is reasoning; it ends on EOS, or on ``length`` cut anywhere;
- stop strings: the output ends at the first step whose text contains one (the first in the
  request's list when several complete at that step), ``matched_stop`` is that string and the
  text is cut before its first occurrence; the token that completed it is counted, as SGLang
  counts it. A stop token id ends the output on that token (counted, not shown); before
  ``min_tokens`` stop token ids are never drawn. A stop string beats a stop token at one step;
- a continuation (``continue_final_message``) of a constrained request starts a new value of
  the grammar, as SGLang's grammar knows nothing of the partial; stop strings are matched in the
  new text only;
- a degraded engine (``POST /_sim/fault`` ``degrade``, :data:`DEGRADES`): ``loop``: after the
  first quarter of its limit the output repeats its last 6 tokens until the limit (``length``);
  ``truncate``: EOS never comes, free text runs to its limit, a grammar's or tool call's text is
  cut halfway (``length``); ``broken_json``: a JSON grammar's value lacks a required property or
  is not JSON (cut, a comma after it), a regex's text gets ``"\\x00\\n"`` after it, a tool call
  lacks a required argument or names an undeclared function; ``empty``: the output ends after
  its reasoning, with no content. Stop strings still cut a degraded output.
"""

from __future__ import annotations

import bisect
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any, Literal

import orjson
import rstr

from server_mgr.sim import ebnf, schemagen, textgen, tokens, toolcalls
from server_mgr.sim.options import Options, rng_for

# A logit_bias at least this large forces its token (at most this negative bans it): a random or
# tiny model's logits spread over a few units; smaller biases leave the sim's output alone.
LOGIT_BIAS_DECIDES = 5.0
Degrade = Literal["loop", "truncate", "broken_json", "empty"]
DEGRADES: tuple[Degrade, ...] = ("loop", "truncate", "broken_json", "empty")
LOOP_TOKENS = 6  # a degraded loop's block


@dataclass(frozen=True, slots=True)
class Output:
    """The generated tokens of one request and how they are shown."""

    tokens: list[str]  # every token generated (``completion_tokens`` counts them)
    reasoning_tokens: int  # leading tokens that are reasoning
    finish_reason: str  # stop | length (tool_calls is decided when the text is parsed)
    matched_stop: int | str | None
    text_end: int  # chars of "".join(tokens) shown: a stop string and what follows are cut
    prompt_tokens: int
    key: bytes  # log-probabilities are drawn from it
    start: int  # position of tokens[0] in the uninterrupted output
    stop: tuple[str, ...] = ()
    offsets: list[int] = field(default_factory=list)  # cumulative chars after each token

    full_text: str = ""  # "".join(tokens), computed once

    @property
    def text(self) -> str:
        return self.full_text[: self.text_end]

    @property
    def reasoning_chars(self) -> int:
        return min(self.offsets[self.reasoning_tokens - 1] if self.reasoning_tokens else 0, self.text_end)

    def ids(self) -> list[int]:
        return tokens.ids(self.tokens)

    def logprobs(self, first: int, last: int, top: int) -> list[dict[str, Any]]:
        """``logprobs.content`` entries of tokens ``first`` to ``last`` (excluded)."""
        return tokens.entries(self.key, self.start + first, self.tokens[first:last], top)

    def shown_after(self, k: int) -> int | None:
        """Chars a stream may show after ``k`` tokens, or None while SGLang holds the output back
        because its text ends with the start of a stop string."""
        end = self.offsets[k - 1] if k else 0
        for s in self.stop:
            if any(self.full_text.endswith(s[:i], 0, end) for i in range(1, len(s) + 1)):
                return None
        return end


def build(
    messages: Sequence[textgen.Message],
    params: dict[str, Any],
    opts: Options,
    *,
    continued: bool,
    tool_parser: str | None,
    degrade: Degrade | None = None,
) -> Output:
    """The output of a request (``params``: those of :func:`textgen.resolve`), as a degraded
    engine writes it with ``degrade``."""
    steer = _steering(opts)
    if degrade == "truncate":
        steer = replace(steer or textgen.Steering(), ignore_eos=True)
    base = textgen.resolve(
        messages, continue_final_message=continued, steering=steer, salt=opts.key_extra, **params
    )
    toks, finish = list(base.tokens), base.finish_reason
    eos = False  # the output ends with the EOS token, counted and given a log-probability
    grammar = _grammar_text(messages, params, opts, base, tool_parser, degrade == "broken_json")
    if grammar is not None:
        # under a grammar the model must end with EOS once the grammar is complete; SGLang
        # counts that token (free text's natural stop does not count it in the sim: see
        # docs/sglang-conformance.md)
        full = [*toks[: base.reasoning_tokens], *tokens.pieces(grammar), tokens.EOS_TEXT]
        toks = full[: _limit(params, base.prompt_tokens)]
        finish = "length" if len(toks) < len(full) else "stop"
        eos = finish == "stop"
        if eos:
            toks.pop()
        if eos and degrade == "truncate":
            toks, finish, eos = toks[: (len(toks) + base.reasoning_tokens) // 2], "length", False
    if degrade == "loop":
        toks, finish, eos = _loop(toks, _limit(params, base.prompt_tokens)), "length", False
    elif degrade == "empty":
        toks, finish, eos = toks[: base.reasoning_tokens], "stop", True
    offsets = list(accumulate(len(t) for t in toks))
    # ignore_eos: free text runs to its limit (textgen); a complete grammar still ends the output
    matched: int | str | None = textgen.EOS_TOKEN_ID if finish == "stop" else None
    n, text_end = len(toks), offsets[-1] if offsets else 0
    hit = _first_stop(toks, offsets, opts)
    if hit is not None:
        n, matched, text_end = hit
        toks, offsets, finish = toks[:n], offsets[:n], "stop"
    elif eos:
        toks.append(tokens.EOS_TEXT)
        offsets.append(text_end + len(tokens.EOS_TEXT))
    return Output(
        tokens=toks,
        reasoning_tokens=min(base.reasoning_tokens, n),
        finish_reason=finish,
        matched_stop=matched,
        text_end=text_end,
        prompt_tokens=base.prompt_tokens,
        key=base.key,
        start=base.start,
        stop=opts.stop,
        offsets=offsets,
        full_text="".join(toks),
    )


def _steering(opts: Options) -> textgen.Steering | None:
    vocab = {tokens.token_id(v): i for i, v in enumerate(textgen.VOCAB)}
    strongest = sorted(opts.logit_bias.items(), key=lambda kv: -kv[1])
    forced = [vocab[t] for t, b in strongest if b >= LOGIT_BIAS_DECIDES and t in vocab]
    banned = frozenset(vocab[t] for t, b in strongest if b <= -LOGIT_BIAS_DECIDES and t in vocab)
    early = frozenset(vocab[t] for t in opts.stop_token_ids if t in vocab)
    if not (forced or banned or early or opts.min_tokens or opts.ignore_eos):
        return None
    return textgen.Steering(
        forced=forced[0] if forced else None,
        banned=banned,
        banned_early=early,
        min_tokens=opts.min_tokens,
        ignore_eos=opts.ignore_eos,
    )


def _limit(params: dict[str, Any], prompt_tokens: int) -> int:
    budget = textgen.generation_budget(
        prompt_tokens, context_length=params["context_length"], max_total_tokens=params["max_total_tokens"]
    )
    return min(budget, params["max_tokens"]) if params.get("max_tokens") else budget


def _loop(toks: list[str], limit: int) -> list[str]:
    """``toks`` looping: its first quarter of ``limit``, then its last tokens over and over."""
    keep = max(1, min(len(toks), limit) // 4)
    block = toks[max(0, keep - LOOP_TOKENS) : keep] or [textgen.VOCAB[0]]
    return toks[:keep] + [block[i % len(block)] for i in range(limit - keep)]


def _grammar_text(
    messages: Sequence[textgen.Message],
    params: dict[str, Any],
    opts: Options,
    base: textgen.Completion,
    tool_parser: str | None,
    broken: bool = False,
) -> str | None:
    """The content a grammar or a tool call makes the model write (``broken``: one that does not
    hold to it); None for free text."""
    # the grammar's own draw: from the whole request, so a continuation draws a new value
    key = base.key + orjson.dumps([messages[-1].get("content") if messages else None])
    if opts.constraint is not None:
        rng = rng_for(key, opts.constraint.kind, opts.constraint.spec)
        if opts.constraint.kind == "regex":
            return rstr.Rstr(rng).xeger(opts.constraint.spec) + ("\x00\n" if broken else "")
        if opts.constraint.kind == "ebnf":
            return ebnf.generate(opts.constraint.spec, rng)
        value = schemagen.generate(opts.constraint.spec, rng)
        text = json.dumps(value, ensure_ascii=False)
        if broken:  # a required property left out, or a text cut (no JSON text ends with a comma)
            dropped = _without_required(value, opts.constraint.spec, rng)
            return text[:-1] + "," if dropped is None else json.dumps(dropped, ensure_ascii=False)
        return text
    if opts.forced_tools or (opts.calls_tools and tool_parser and rng_for(key, "auto").random() < 0.5):
        calls = toolcalls.planned_calls(opts, key)
        if broken:
            params = {t["function"]["name"]: t["function"].get("parameters") for t in opts.tools}
            rng = rng_for(key, "broken")
            calls = [
                (name, fixed)
                if (fixed := _without_required(args, params[name], rng)) is not None
                else (name + "_undeclared", args)
                for name, args in calls
            ]
        return toolcalls.render(calls, tool_parser)
    return None


def _without_required(value: Any, schema: Any, rng: random.Random) -> Any:
    """``value`` without its schema's first required property, for half the draws of ``rng``
    (None: the other half, or no such property)."""
    required = schema.get("required") if isinstance(schema, dict) else None
    if not (isinstance(value, dict) and required and required[0] in value) or rng.random() < 0.5:
        return None
    return {k: v for k, v in value.items() if k != required[0]}


def _first_stop(toks: list[str], offsets: list[int], opts: Options) -> tuple[int, int | str, int] | None:
    """(tokens kept, matched, chars shown) of the first stop string or stop token, or None."""
    best: tuple[int, int, int | str, int] | None = None  # (step, rank, matched, shown)
    if opts.stop:
        text = "".join(toks)
        for rank, s in enumerate(opts.stop):
            pos = text.find(s) if s else -1
            if pos == -1:
                continue
            step = bisect.bisect_left(offsets, pos + len(s)) + 1
            cand = (step, rank, s, pos)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if opts.stop_token_ids:
        for i, tok in enumerate(toks):
            if i >= opts.min_tokens and tokens.token_id(tok) in opts.stop_token_ids:
                if best is None or i + 1 < best[0]:
                    best = (i + 1, len(opts.stop), tokens.token_id(tok), offsets[i] - len(tok))
                break
    if best is None:
        return None
    step, _, matched, shown = best
    return step, matched, shown
