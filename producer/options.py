"""Request options checked at enqueue, so that a bad value is an error naming its row and option
now rather than a failed job hours later.

Each option's value is checked alone (:func:`check_option`: types and ranges as SGLang 0.5.23
checks them, a ``json_schema`` and tool ``parameters`` against the JSON Schema meta-schema, a
``regex`` compiled), then a request's options together (:func:`check_request`: one grammar at
most, a named tool that exists, ``top_logprobs`` with ``logprobs``...). The names, and which are
refused, are in :mod:`tokenmill.options`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeGuard

import orjson

from producer.limits import DEFAULT, INT32_MAX, INT64_MAX, Limits, depth_problem, option_problem
from producer.readers import json_kind
from tokenmill.errors import InputError
from tokenmill.options import GRAMMARS, OPTIONS, REFUSED, RUN_REFUSED

_SHOW_CHARS = 60
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
TOOL_CHOICES = ("none", "auto", "required")
FORMATS = ("text", "json_object", "json_schema", "structural_tag")


class Bad(ValueError):
    """An option's value is wrong; the caller names the row and the option."""


def check_option(source: str, name: str, value: Any, limits: Limits = DEFAULT) -> Any:
    """``value`` for option ``name`` as it will be sent, or :class:`InputError` naming both; its
    nesting was bounded already (:func:`producer.limits.depth_problem`)."""
    if name in REFUSED:
        raise InputError(source, f'"{name}" cannot be set: {REFUSED[name]}')
    if name == "n":
        if value == 1:
            return value
        why = "for several completions of a prompt, enqueue with --samples N"
        raise InputError(source, f'"n" must be 1 (got {_show(value)}): {why}')
    if (too_big := option_problem(name, value, limits)) is not None:
        raise InputError(source, f'"{name}" {too_big}')
    try:
        return _CHECKS[name](value)
    except Bad as exc:
        problem = str(exc)
        joined = f'"{name}" {problem}' if problem.startswith("must") else f'"{name}": {problem}'
        raise InputError(source, joined) from None


def check_request(source: str, options: Mapping[str, Any], max_tokens: int) -> None:
    """The options of one request, together (each was checked alone already)."""
    text = (options.get("response_format") or {}).get("type") == "text"  # a text format constrains nothing
    grammars = [g for g in GRAMMARS if options.get(g) is not None and not (text and g == "response_format")]
    if len(grammars) > 1:
        got = " and ".join(grammars)
        raise InputError(source, f"only one of {', '.join(GRAMMARS)} may be set; got {got}")
    choice = options.get("tool_choice")
    tools = options.get("tools")
    if choice not in (None, "none", "auto") and not tools:
        raise InputError(source, f'"tool_choice" {_show(choice)} needs "tools"')
    if isinstance(choice, dict):
        wanted = choice["function"]["name"]
        names = [t["function"]["name"] for t in tools or ()]
        if wanted not in names:
            known = ", ".join(names)
            raise InputError(source, f'"tool_choice" names {wanted!r}, which "tools" lacks ({known})')
    if grammars and tools and (choice == "required" or isinstance(choice, dict)):
        raise InputError(
            source,
            f'tool_choice {_show(choice)} cannot be combined with "{grammars[0]}": SGLang cannot honour '
            "the tool-call constraint and the output constraint both",
        )
    if options.get("top_logprobs") and not options.get("logprobs"):
        raise InputError(source, '"top_logprobs" needs "logprobs": true')
    min_tokens = options.get("min_tokens") or 0
    if min_tokens > max_tokens:
        raise InputError(source, f'"min_tokens" ({min_tokens}) is above max_tokens ({max_tokens})')


def run_params(
    params_file: str | None,
    params: tuple[str, ...] | list[str],
    flags: Mapping[str, Any],
    limits: Limits = DEFAULT,
) -> dict[str, Any]:
    """A run's request options: ``--params FILE.json``, then each ``--param NAME=JSON`` (a later
    one wins), then the flags that are options (``--temperature``...) when set."""
    out: dict[str, Any] = {}
    if params_file:
        for name, value in _load_params_file(params_file).items():
            out[name] = check_run_option(params_file, name, value, limits)
    for text in params:
        name, value = _parse_param(text)
        out[name] = check_run_option(f"--param {name}", name, value, limits)
    for name, value in flags.items():
        if value is not None:
            out[name] = check_run_option(f"--{name.replace('_', '-')}", name, value, limits)
    return out


def run_options(
    params: Mapping[str, Any] | None, flags: Mapping[str, Any], limits: Limits = DEFAULT
) -> dict[str, Any]:
    """A run's request options given in Python (``Client.enqueue``): ``params``, then the
    arguments that are options (``temperature``...) when set; each checked as ``--param`` is,
    an error naming it ``params['stop']`` or ``temperature``."""
    if params is not None and not isinstance(params, Mapping):
        raise InputError("params", f"expected a dict of request options, got {json_kind(params)}")
    out: dict[str, Any] = {}
    for name, value in (params or {}).items():
        out[name] = check_run_option(f"params[{name!r}]", name, value, limits)
    for name, value in flags.items():
        if value is not None:
            out[name] = check_run_option(name, name, value, limits)
    return out


def check_run_option(source: str, name: str, value: Any, limits: Limits = DEFAULT) -> Any:
    """A run-wide option: any option, but none of a row's own fields."""
    if name in RUN_REFUSED:
        raise InputError(source, f'"{name}" cannot be a run-wide option: {RUN_REFUSED[name]}')
    if name not in OPTIONS and name not in REFUSED and name != "n":
        known = ", ".join(sorted(OPTIONS))
        raise InputError(source, f"{name!r} is not a request option tokenmill knows; known: {known}")
    if (too_deep := depth_problem(value, limits)) is not None:
        raise InputError(source, f'"{name}" {too_deep}')
    to_json(source, f'"{name}"', value)
    return check_option(source, name, value, limits)


def to_json(source: str, what: str, value: Any, option: int = 0) -> bytes:
    """``value`` as JSON, or :class:`InputError` naming ``what`` when JSON cannot hold it (bytes,
    decimals, an integer past 64 bits, from a Python or Arrow row): jobs are stored as JSON."""
    try:
        return orjson.dumps(value, option=option)
    except TypeError as exc:
        raise InputError(source, f"{what} cannot be stored as JSON: {exc}") from None


def _load_params_file(path: str) -> dict[str, Any]:
    try:
        data = orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise InputError(path, f"cannot read: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise InputError(path, f"invalid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    if not isinstance(data, dict):
        raise InputError(path, f"expected a JSON object of request options, got {json_kind(data)}")
    return data


def _parse_param(text: str) -> tuple[str, Any]:
    name, eq, raw = text.partition("=")
    if not eq or not name:
        raise InputError(f"--param {text}", "expected NAME=JSON, e.g. --param 'stop=[\"\\n\\n\"]'")
    try:
        return name, orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InputError(
            f"--param {name}",
            f"{raw!r} is not JSON (strings need quotes: --param '{name}=\"{raw}\"')",
        ) from None


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _show(value: Any) -> str:
    """``repr(value)``, cut short for display in an error message."""
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


# --- one option's value --------------------------------------------------------------------------


def _must(
    test: Callable[[Any], object], what: str, show: Callable[[Any], str] = _show
) -> Callable[[Any], Any]:
    """A check: the value itself when ``test`` holds, else :class:`Bad` saying it must be ``what``."""

    def check(value: Any) -> Any:
        if not test(value):
            raise Bad(f"must be {what}, got {show(value)}")
        return value

    return check


def _number(low: float, high: float | None, low_open: bool = False) -> Callable[[Any], float]:
    if high is None:
        where = f"{'>' if low_open else '>='} {low:g}"
    else:
        where = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    within = _must(
        lambda v: _is_number(v) and (v > low if low_open else v >= low) and (high is None or v <= high),
        f"a number {where}",
    )
    # 1 and 1.0 are one job (and ids made before options kept floats)
    return lambda value: float(within(value))


def _integer(low: int, high: int) -> Callable[[Any], int]:
    return _must(lambda v: _is_int(v) and low <= v <= high, f"an integer in [{low}, {high}]")


_boolean = _must(lambda v: isinstance(v, bool), "true or false")
_object = _must(lambda v: isinstance(v, dict), "an object", json_kind)
_seed = _must(lambda v: _is_int(v) and -(2**63) <= v < 2**63, "a 64-bit integer")
_top_k = _must(
    lambda v: _is_int(v) and (v == -1 or 1 <= v <= INT32_MAX), f"-1 (off) or an integer in [1, {INT32_MAX}]"
)
_token_ids = _must(
    lambda v: isinstance(v, list) and all(_is_int(t) and 0 <= t <= INT64_MAX for t in v),
    f"a list of token ids (integers in [0, {INT64_MAX}])",
)
_ebnf = _must(lambda v: isinstance(v, str) and v and not v.isspace(), "a non-empty grammar string", json_kind)
_lora_path = _must(lambda v: isinstance(v, str) and v, "the name of a loaded LoRA adapter (a string)")
_reasoning_effort = _must(
    lambda v: (isinstance(v, str) and v in EFFORTS) or (_is_number(v) and 0 <= v <= 0.99),
    f"one of {', '.join(EFFORTS)} or a number in [0, 0.99]",
)


def _any_json(value: Any) -> Any:
    return value


def _logit_bias(value: Any) -> dict[str, float]:
    bias: dict[str, float] = _object(value)
    for token, b in bias.items():
        if not _is_token_key(token):
            raise Bad(f"keys must be token ids (digits, at most {INT64_MAX}), got {_show(token)}")
        if not _is_number(b) or not -100 <= b <= 100:
            raise Bad(f"values must be numbers in [-100, 100], got {_show(b)} for token {token}")
    return bias


def _is_token_key(key: Any) -> bool:
    """A token id as a JSON object key: ASCII digits, within int64 (int() of 4,300+ digits raises)."""
    return (
        isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19 and int(key) <= INT64_MAX
    )


def _strings(what: str, each: Callable[[str], object] | None = None) -> Callable[[Any], Any]:
    """A non-empty string, or a list of them."""

    def check(value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise Bad(f"must be a {what} or a non-empty list of them, got {json_kind(value)}")
        for item in items:
            if not isinstance(item, str) or not item:
                raise Bad(f"each must be a non-empty string, got {_show(item)}")
            if each is not None:
                each(item)
        return value

    return check


def _compiles(pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise Bad(f"{pattern!r} does not compile: {exc}") from None


def _regex(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Bad(f"must be a non-empty string, got {json_kind(value)}")
    _compiles(value)
    return value


def _response_format(value: Any) -> dict[str, Any]:
    fmt: dict[str, Any] = _object(value)
    kind = fmt.get("type")
    if kind not in FORMATS:
        raise Bad(f'"type" must be one of {", ".join(FORMATS)}, got {_show(kind)}')
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None and isinstance(fmt.get("schema"), dict):  # SGLang's shorthand
            spec = {"name": "schema", "schema": fmt["schema"]}
        if not isinstance(spec, dict):
            raise Bad('type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
        if not isinstance(spec.get("name"), str) or not _NAME.match(spec["name"]):
            name = _show(spec.get("name"))
            raise Bad(f'"json_schema.name" must be 1-64 letters, digits, _ or -, got {name}')
        if "strict" in spec and not isinstance(spec["strict"], bool):
            raise Bad(f'"json_schema.strict" must be true or false, got {_show(spec["strict"])}')
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise Bad(f'"json_schema.schema" must be a JSON Schema object, got {json_kind(schema)}')
        _check_schema("json_schema.schema", schema)
    return fmt


def _check_schema(where: str, schema: dict[str, Any]) -> None:
    problem = _schema_problem(orjson.dumps(schema))
    if problem:
        raise Bad(f'"{where}" is not a valid JSON Schema: {problem}')


@lru_cache(maxsize=256)
def _schema_problem(schema_json: bytes) -> str | None:
    """Why a schema is invalid against its meta-schema (None: valid); cached, as a run's rows
    usually share a few schemas."""
    from jsonschema import SchemaError, validators

    schema = orjson.loads(schema_json)
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return f"{exc.message} (at {path})"
    return None


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise Bad(f"must be a non-empty list of tool definitions, got {json_kind(value)}")
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise Bad(f'{where} must be {{"type": "function", "function": {{...}}}}, got {_show(tool)}')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise Bad(f'{where} has no "function" object')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise Bad(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {_show(name)}")
        if name in seen:
            raise Bad(f"{where}: function {name!r} is defined twice")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise Bad(f"{where}.function.description must be a string")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                kind = json_kind(params)
                raise Bad(f"{where}.function.parameters must be a JSON Schema object, got {kind}")
            _check_schema(f"{where}.function.parameters", params)
    return value


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise Bad(f"must be one of {', '.join(TOOL_CHOICES)} or a named function, got {value!r}")
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or value.get("type") != "function":
        named = '{"type": "function", "function": {"name": ...}}'
        raise Bad(f'must be "none", "auto", "required" or {named}, got {_show(value)}')
    return value


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "temperature": _number(0, None),
    "top_p": _number(0, 1, low_open=True),
    "top_k": _top_k,
    "min_p": _number(0, 1),
    "seed": _seed,
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "repetition_penalty": _number(0, 2, low_open=True),
    "logit_bias": _logit_bias,
    "min_tokens": _integer(0, INT32_MAX),
    "ignore_eos": _boolean,
    "no_stop_trim": _boolean,
    "skip_special_tokens": _boolean,
    "stop": _strings("string"),
    "stop_token_ids": _token_ids,
    "stop_regex": _strings("regex", _compiles),
    "response_format": _response_format,
    "regex": _regex,
    "ebnf": _ebnf,
    "tools": _tools,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _boolean,
    "chat_template_kwargs": _object,
    "reasoning_effort": _reasoning_effort,
    "thinking": _any_json,
    "separate_reasoning": _boolean,
    "logprobs": _boolean,
    "top_logprobs": _integer(0, 20),
    "return_token_ids": _boolean,
    "lora_path": _lora_path,
}
assert set(_CHECKS) == OPTIONS, "every option has its check"
