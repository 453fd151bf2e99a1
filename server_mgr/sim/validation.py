"""Checks a chat request the way SGLang 0.5.23 does and turns it into a :class:`ChatPlan`.

Order follows the real server: request-model checks (messages), then the tokenizer manager's
context-length checks (§4.2), then sampling parameters (§4.4). Failures raise
:class:`RequestError`, rendered as the OpenAI error envelope with the same message text.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from server_mgr.sim import decode, textgen
from server_mgr.sim.config import SimConfig
from server_mgr.sim.errors import RequestError
from server_mgr.sim.logs import SimLog
from server_mgr.sim.options import Options, grammar_error, parse_options

ROLES = frozenset({"system", "user", "assistant", "tool"})
GREEDY_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature is greedy decoding


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """Everything a chat request needs once accepted."""

    rid: str
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    output: decode.Output
    opts: Options
    reasoning: bool  # the reasoning parser separates this request's thinking
    tool_parsing: bool  # the tool-call parser reads this request's output
    parsers: bool  # the server runs a reasoning or tool-call parser (where logprobs go)
    abort: str | None  # the scheduler aborts the request with this message (a bad grammar)
    max_new_tokens: int  # the limit the scheduler knows (clamped to the context)

    @property
    def outputs(self) -> list[decode.Output]:
        """The choices' outputs (one: the sim answers ``n > 1`` with one choice)."""
        return [self.output]


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{name}: Input should be a valid number", type_="Bad Request")
    return float(value)


def _int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name}: Input should be a valid integer", type_="Bad Request")
    return value


def check_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The request's messages; 400 when missing, empty or with an unknown role."""
    messages = body.get("messages")
    if messages is None:
        raise RequestError("messages: Field required", type_="Bad Request")
    if not isinstance(messages, list):
        raise RequestError("messages: Input should be a valid list", type_="Bad Request")
    if not messages:
        raise RequestError("Messages cannot be empty.")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise RequestError(
                f"messages.{i}.role: Input should be 'system', 'user', 'assistant' or 'tool' (got {role!r})",
                type_="Bad Request",
            )
    return messages


def check_sampling(body: Mapping[str, Any], max_new_tokens: int | None) -> None:
    """SGLang 0.5.23's sampling-parameter checks, with its messages."""
    t = _number(body, "temperature")
    if t is not None and (t < 0 or not math.isfinite(t)):
        raise RequestError(f"temperature must be a non-negative finite number, got {t}.")
    p = _number(body, "top_p")
    if p is not None and not 0 < p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {p}.")
    k = _int(body, "top_k")
    if t is not None and t < GREEDY_EPS:
        k = None  # greedy: SGLang sets top_k to 1 before checking it
    if k is not None and k != -1 and k < 1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {k}.")
    mp = _number(body, "min_p")
    if mp is not None and not 0 <= mp <= 1:
        raise RequestError(f"min_p must be in [0, 1], got {mp}.")
    for name in ("frequency_penalty", "presence_penalty"):
        v = _number(body, name)
        if v is not None and not -2 <= v <= 2:
            raise RequestError(f"{name} must be in [-2, 2], got {v}.")
    rp = _number(body, "repetition_penalty")
    if rp is not None and not 0 < rp <= 2:
        raise RequestError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rp}.")
    if max_new_tokens is not None and max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new_tokens}.")


# How SGLang 0.5.23's reasoning parsers decide whether a request thinks (``reasoning_default``
# of each detector): "always" ignores the chat template kwargs; "enable_thinking" and "thinking"
# think unless that kwarg is false; the "explicit_" modes only when it is true. Parsers not
# listed behave as qwen3.
REASONING_DEFAULTS = {
    "deepseek-r1": "always",
    "step3": "always",
    "kimi": "always",
    "gpt-oss": "always",
    "hunyuan": "always",
    "minimax-append-think": "always",
    "kimi_k2": "thinking",
    "kimi_k3": "thinking",
    "deepseek-v3": "explicit_thinking",
    "deepseek-v4": "explicit_thinking",
    "mimo": "explicit_enable_thinking",
    "gemma4": "explicit_enable_thinking",
}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")


def _reasoning_on(body: Mapping[str, Any], cfg: SimConfig) -> bool:
    if not cfg.reasoning_parser or body.get("separate_reasoning", True) is False:
        return False
    kwargs = dict(body.get("chat_template_kwargs") or {})
    effort = _reasoning_effort(body)
    if effort is not None:  # SGLang: effort "none" defaults both toggles to false, others to true
        kwargs.setdefault("thinking", effort != "none")
        kwargs.setdefault("enable_thinking", effort != "none")
    mode = REASONING_DEFAULTS.get(cfg.reasoning_parser, "enable_thinking")
    if mode == "always":
        return True
    if mode.startswith("explicit_"):
        return kwargs.get(mode.removeprefix("explicit_")) is True
    return kwargs.get(mode) is not False


def _reasoning_effort(body: Mapping[str, Any]) -> str | float | None:
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    if isinstance(effort, bool):
        raise RequestError(
            "reasoning_effort: Value error, reasoning_effort must not be a boolean", type_="Bad Request"
        )
    if isinstance(effort, str) and effort in REASONING_EFFORTS:
        return effort
    if isinstance(effort, int | float) and 0.0 <= effort <= 0.99:
        return float(effort)
    raise RequestError(
        "reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium', 'high', 'xhigh', "
        "'ultra' or 'max' or reasoning_effort: Input should be a valid number",
        type_="Bad Request",
    )


def _check_context(prompt: int, max_new: int | None, cfg: SimConfig, log: SimLog) -> int | None:
    """§4.2: refuse (or with --allow-auto-truncate clamp) what does not fit the context."""
    ctx = cfg.context_len
    if prompt >= ctx:
        if not cfg.allow_auto_truncate:
            raise RequestError(
                f"The input ({prompt} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        log.warning(
            f"The input ({prompt} tokens) is longer than the model's context length ({ctx} "
            "tokens). Truncating the input."
        )
        return None
    if max_new is not None and prompt + max_new > ctx:
        if not cfg.allow_auto_truncate:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {prompt + max_new} tokens: {prompt} tokens "
                f"from the input messages and {max_new} tokens for the completion. Please reduce "
                "the number of tokens in the input messages or the completion to fit within the "
                "limit."
            )
        log.warning(
            f"Requested token count ({prompt} input + {max_new} new) exceeds the model's "
            f"context length ({ctx} tokens). Truncating max_new_tokens."
        )
        return ctx - prompt
    return max_new


def _truncated_input(
    messages: list[dict[str, Any]], params: dict[str, Any], continued: bool, cfg: SimConfig, opts: Options
) -> decode.Output:
    """With --allow-auto-truncate, an over-long input is cut to the scheduler's input limit.

    The output is the same token sequence, now with the budget of the truncated input.
    """
    prompt = cfg.max_req_input_len
    budget = textgen.generation_budget(
        prompt, context_length=cfg.context_len, max_total_tokens=cfg.max_total_tokens
    )
    limit = min(budget, params["max_tokens"] or budget)
    unbounded = {**params, "max_tokens": limit, "context_length": 2**40, "max_total_tokens": None}
    output = decode.build(messages, unbounded, opts, continued=continued, tool_parser=cfg.tool_call_parser)
    return replace(output, prompt_tokens=prompt)


def plan_chat(
    body: Mapping[str, Any], cfg: SimConfig, log: SimLog, degrade: decode.Degrade | None = None
) -> ChatPlan:
    """Validate a /v1/chat/completions body and compute its deterministic output (``degrade``:
    the ``POST /_sim/fault`` switch, :func:`server_mgr.sim.decode.build`)."""
    messages = check_messages(body)
    _reasoning_effort(body)  # a field of the request model: checked with or without a parser
    stream = bool(body.get("stream", False))
    opts = parse_options(body, stream=stream)
    abort = grammar_error(opts.constraint) if opts.constraint else None
    if abort:  # the scheduler aborts it before a token: nothing to draw from the grammar
        opts = replace(opts, constraint=None)
    # 0.5.23: max_completion_tokens wins; 0 is falsy, i.e. unlimited
    max_new = _int(body, "max_completion_tokens") or _int(body, "max_tokens") or None
    seed = _int(body, "seed")
    params: dict[str, Any] = dict(
        seed=seed,
        temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"),
        max_tokens=max_new if max_new and max_new > 0 else None,
        reasoning=_reasoning_on(body, cfg),
        mean_output_tokens=cfg.mean_output_tokens,
        perturb=cfg.perturb,
        sim_seed=cfg.seed,
        context_length=cfg.context_len,
        max_total_tokens=cfg.max_total_tokens,
    )
    continued = bool(body.get("continue_final_message"))
    if continued and cfg.refuse_continuations:
        raise RequestError(
            "continue_final_message cannot be applied: this server's chat template does not "
            "continue a final assistant message (sim fault --sim-refuse-continuations)"
        )
    try:
        output = decode.build(
            messages, params, opts, continued=continued, tool_parser=cfg.tool_call_parser, degrade=degrade
        )
    except textgen.ContinuationError as exc:
        raise RequestError(str(exc)) from None
    limit = _check_context(output.prompt_tokens, max_new, cfg, log)
    if output.prompt_tokens >= cfg.context_len:
        output = _truncated_input(messages, params, continued, cfg, opts)
    elif output.prompt_tokens > cfg.max_req_input_len:
        raise RequestError(
            f"Input length ({output.prompt_tokens} tokens) exceeds the maximum allowed "
            f"length ({cfg.max_req_input_len} tokens). Use a shorter input or enable "
            "--allow-auto-truncate."
        )
    check_sampling(body, max_new)
    if max_new and opts.min_tokens > max_new:
        raise RequestError(
            f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {opts.min_tokens}."
        )
    budget = textgen.generation_budget(
        output.prompt_tokens,
        context_length=cfg.context_len,
        max_total_tokens=cfg.max_total_tokens,
    )
    rid = body.get("rid")
    options = body.get("stream_options") or {}
    return ChatPlan(
        rid=rid if isinstance(rid, str) and rid else uuid.uuid4().hex,
        model=str(body.get("model") or "default"),
        stream=stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        continuous_usage=bool(isinstance(options, dict) and options.get("continuous_usage_stats")),
        output=output,
        opts=opts,
        reasoning=bool(params["reasoning"]),
        tool_parsing=bool(cfg.tool_call_parser and opts.calls_tools),
        parsers=bool(cfg.tool_call_parser or cfg.reasoning_parser),
        abort=abort,
        max_new_tokens=max(len(output.tokens), min(limit or budget, budget)),
    )
