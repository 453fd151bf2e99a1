"""The generation options of a chat request, checked the way SGLang 0.5.23 checks them.

Covers what ``ChatCompletionRequest`` adds to plain sampling: stop strings and stop token ids,
``min_tokens``/``ignore_eos``, the output constraints (``response_format``, ``regex``,
``ebnf``), tools and ``tool_choice``, log-probabilities, token ids, ``logit_bias``, the
penalties, ``n`` and ``lora_path``. Failures raise :class:`RequestError` with SGLang's message
and error type, in SGLang's order: the request model's field types, the handler's own checks
(``_validate_request``), the conversion to a generate request, then the sampling parameters.
A grammar that does not compile is not refused here: SGLang aborts it in the scheduler
(:func:`grammar_error`).
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import orjson

from server_mgr.sim import ebnf, tokens
from server_mgr.sim.errors import RequestError

MAX_STOP_COUNT = 32
TOOL_CHOICES = ("none", "auto", "required")
# Sampling options that change a sampled output (not a greedy one: top_k and min_p keep the most
# probable token). The penalties act only on tokens already generated; measured on SGLang, a
# greedy output of 8 tokens was the same with and without them, and the sim leaves its output
# alone for them.
SAMPLED_ONLY = ("top_k", "min_p")


@dataclass(frozen=True, slots=True)
class Constraint:
    """An output grammar: ``kind`` is ``json_schema``, ``regex`` or ``ebnf`` (SGLang's names)."""

    kind: str
    spec: Any  # the schema (a dict) or the regex / grammar text


@dataclass(frozen=True, slots=True)
class Options:
    """What the output of one request depends on, beyond messages and sampling."""

    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    ignore_eos: bool = False
    constraint: Constraint | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "none"  # none | auto | required | named
    tool_name: str | None = None  # the function of a named tool_choice
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    output_ids_in_sglext: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1
    key_extra: tuple[Any, ...] = ()  # option values that change the output, for its hash

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tools(self) -> bool:
        """``required`` or a named function: SGLang constrains the output to tool calls."""
        return bool(self.tools) and self.tool_choice in ("required", "named")


def _type_error(name: str, what: str) -> RequestError:
    return RequestError(f"{name}: Input should be {what}", type_="Bad Request")


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a valid boolean")
    return value


def _int(body: Mapping[str, Any], name: str, default: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "a valid integer")
    return value


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _type_error("stop", "a valid string or a valid list of strings")
    return tuple(stop)


def _token_ids(body: Mapping[str, Any]) -> frozenset[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return frozenset()
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _type_error("stop_token_ids", "a valid list of integers")
    return frozenset(ids)


def _tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise _type_error("tools", "a valid list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise RequestError(f"tools.{i}.function: Field required", type_="Bad Request")
        if not isinstance(fn.get("name"), str):
            raise RequestError(f"tools.{i}.function.name: Field required", type_="Bad Request")
    return tuple(tools)


def _tool_choice(body: Mapping[str, Any], tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise RequestError(
                "tool_choice: Input should be a valid dictionary or object to extract fields from "
                "or Input should be 'auto', 'required' or 'none'",
                type_="Bad Request",
            )
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict):
        raise RequestError("tool_choice.function: Field required", type_="Bad Request")
    return "named", fn.get("name")


def _check_tools(opts: Options) -> None:
    """``_validate_request``'s tool checks, with its messages."""
    if opts.tool_choice == "required" and not opts.tools:
        raise RequestError("Tools cannot be empty if tool choice is set to required.")
    if opts.tool_choice == "named":
        if not opts.tools:
            raise RequestError("Tools cannot be empty if tool choice is set to a specific tool.")
        if not any(t["function"]["name"] == opts.tool_name for t in opts.tools):
            raise RequestError(f"Tool '{opts.tool_name}' not found in tools list.")
    for i, tool in enumerate(opts.tools):
        params = tool["function"].get("parameters")
        if params is None:
            continue
        try:
            jsonschema.Draft202012Validator.check_schema(params)
        except jsonschema.SchemaError as exc:
            raise RequestError(f"Tool {i} function has invalid 'parameters' schema: {exc}") from None


def _constraint(body: Mapping[str, Any]) -> list[Constraint]:
    """Every output constraint the request sets (SGLang refuses more than one)."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema", "structural_tag"):
            raise RequestError(
                "response_format.ResponseFormat.type: Input should be 'text', 'json_object' or 'json_schema'",
                type_="Bad Request",
            )
        if kind == "json_object":
            found.append(Constraint("json_schema", {"type": "object"}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema") or {}
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                schema = fmt.get("schema")  # SGLang also reads a bare `schema`
            if schema is None:
                raise RequestError("schema_ is required for json_schema response format request.")
            found.append(Constraint("json_schema", schema))
    for kind in ("regex", "ebnf"):
        value = body.get(kind)
        if value is not None:
            if not isinstance(value, str):
                raise _type_error(kind, "a valid string")
            found.append(Constraint(kind, value))
    return found


def _logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise _type_error("logit_bias", "a valid dictionary")
    out = {}
    for key, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _type_error(f"logit_bias.{key}", "a valid number")
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"invalid literal for int() with base 10: {key!r}") from None
        if not 0 <= token < tokens.VOCAB_SIZE:
            raise RequestError(f"logit_bias must has keys in [0, {tokens.VOCAB_SIZE - 1}], got {token}.")
        out[token] = float(value)
    return out


def parse_options(body: Mapping[str, Any], *, stream: bool, lora: bool = False) -> Options:
    """The options of ``body``; RequestError with SGLang's message when one is refused."""
    tools = _tools(body)
    choice, name = _tool_choice(body, tools)
    constraints = _constraint(body)
    opts = Options(
        stop=_stop(body),
        stop_token_ids=_token_ids(body),
        min_tokens=_int(body, "min_tokens", 0) or 0,
        ignore_eos=_bool(body, "ignore_eos"),
        constraint=constraints[0] if constraints else None,
        tools=tools,
        tool_choice=choice,
        tool_name=name,
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
        logprobs=_bool(body, "logprobs"),
        top_logprobs=_int(body, "top_logprobs", 0) or 0,
        return_token_ids=_bool(body, "return_token_ids"),
        output_ids_in_sglext=_bool(body, "return_output_ids_in_sglext"),
        logit_bias=_logit_bias(body),
        n=_int(body, "n", 1) or 1,
        key_extra=_key_extra(body),
    )
    _check_tools(opts)
    if stream and opts.return_token_ids:
        raise RequestError(
            "return_token_ids is not supported with streaming on /v1/chat/completions. Please "
            "set stream=false when using return_token_ids=true.",
            type_="BadRequest",
        )
    if opts.forced_tools and constraints:
        raise RequestError(
            "tool_choice 'required' or a named tool cannot be combined with response_format, "
            "regex, or ebnf: the tool-call constraint and the output constraint cannot both be "
            "honored.",
            type_="BadRequest",
        )
    lora_path = body.get("lora_path")
    model = str(body.get("model") or "")
    adapter = model.partition(":")[2].strip() if ":" in model else None
    if (adapter or lora_path) and not lora:
        raise RequestError(lora_disabled(adapter or lora_path))
    if len(opts.stop) > MAX_STOP_COUNT:
        raise RequestError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(opts.stop)}")
    if opts.min_tokens < 0:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {opts.min_tokens}.")
    if len(constraints) > 1:
        raise RequestError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    return opts


def lora_disabled(adapter: Any) -> str:
    """What SGLang answers to a LoRA adapter when the server runs without --enable-lora."""
    return (
        f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please launch the "
        "server with --enable-lora flag and preload adapters using --lora-paths or "
        "/load_lora_adapter endpoint."
    )


def _key_extra(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """Option values that change a sampled output (none changes a greedy one)."""
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and temperature < 1e-6:
        return ()
    defaults = {"top_k": -1, "min_p": 0.0}
    return tuple((n, body[n]) for n in SAMPLED_ONLY if body.get(n) is not None and body[n] != defaults[n])


def grammar_error(constraint: Constraint) -> str | None:
    """SGLang's abort message for a grammar xgrammar cannot compile (None when it compiles):
    ``Failed to compile <kind> grammar: `` and xgrammar's own error line."""
    detail = None
    if constraint.kind == "regex":
        detail = _regex_error(constraint.spec)
    elif constraint.kind == "ebnf":
        try:
            ebnf.parse(constraint.spec)
        except ebnf.GrammarError as exc:
            detail = f"grammar_parser.cc:820: EBNF parser error at {exc}"
    else:
        detail = _schema_error(constraint.spec)
    if detail is None:
        return None
    stamp = time.strftime("%H:%M:%S")
    kind = "json" if constraint.kind == "json_schema" else constraint.kind  # SGLang's grammar key
    return f"Failed to compile {kind} grammar: [{stamp}] /project/cpp/{detail}\n"


def _regex_error(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except re.error as exc:
        where = "regex_converter.cc:94: Regex parsing error at position"
        if exc.msg.startswith("missing ), unterminated subpattern"):
            return f"{where} {len(pattern) + 1}: The parenthesis is not closed."
        return f"{where} {(exc.pos or 0) + 1}: {exc.msg}"
    return None


def _schema_error(schema: Any) -> str | None:
    """xgrammar's wording for a ``type`` it does not know, else jsonschema's first line."""
    where = "json_schema_converter.cc:5082: "
    if not isinstance(schema, dict):
        return where + "the schema is not a JSON object"
    for node in _schema_nodes(schema):
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if kind is not None and not all(isinstance(k, str) for k in kinds):
            return where + "Type should be a string"
        for k in kinds:
            if k is not None and k not in JSON_TYPES:
                return where + f'Unsupported type "{k}"'
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return where + str(exc).splitlines()[0]
    return None


JSON_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


def _schema_nodes(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _schema_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schema_nodes(value)


def rng_for(key: bytes, *parts: Any) -> random.Random:
    """A seeded RNG for ``key`` and ``parts`` (the same every run, on every machine)."""
    digest = hashlib.blake2b(key + orjson.dumps(parts, option=orjson.OPT_SORT_KEYS), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))
