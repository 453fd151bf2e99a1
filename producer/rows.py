"""Input rows → normalized requests, validated so that every problem names its row.

A row has ``messages`` (an OpenAI chat list) or ``prompt`` (a string, sent as one user message),
and optionally ``id``, ``max_tokens``, ``metadata`` and request options: a top-level field that
names a generation option of SGLang's chat API (``stop``, ``response_format``, ``tools``,
``logprobs``..., :mod:`tokenmill.options`) is that request's option, checked here
(:mod:`producer.options`). Every other top-level field is kept in ``metadata`` under its own name.

An OpenAI Batch API line (``custom_id``, ``method``, ``url``, ``body``) is read as the row its
``body`` is, with ``custom_id`` as its id; the body's ``model`` (an OpenAI model name, not the
server's) is kept in ``metadata``.

A field whose value is null counts as absent, and null-valued keys inside messages are dropped:
Parquet and Arrow fill fields a row does not have with nulls, and a row must mean the same thing
whichever format it came in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from producer.limits import DEFAULT, Limits, check_max_tokens, depth_problem
from producer.options import _is_int, _show, check_option, to_json
from producer.readers import json_kind
from tokenmill.errors import InputError
from tokenmill.options import OPTIONS, REFUSED

ROLES = ("system", "developer", "user", "assistant", "tool")
ROW_FIELDS = frozenset({"messages", "prompt", "id", "max_tokens", "max_completion_tokens", "metadata"})
_OPTION_LIKE = OPTIONS | REFUSED.keys() | {"n"}  # fields read as options (refused ones raise)
BATCH_FIELDS = frozenset({"custom_id", "method", "url", "body"})
BATCH_URL = "/v1/chat/completions"


@dataclass(slots=True)
class Row:
    """One validated request: chat messages plus the row's own options and metadata.

    ``messages_json`` (sorted keys) and ``metadata_json`` are the two serialized once here, as the
    check that they can be stored; the job spec is assembled from them without dumping again.
    Not frozen, like :class:`~tokenmill.jobspec.JobSpec` (one per row); treat it as a value.
    """

    messages: list[dict[str, Any]]
    record_id: str | None = None
    max_tokens: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # request options, checked
    messages_json: bytes = field(default=b"", compare=False, repr=False)
    metadata_json: bytes = field(default=b"{}", compare=False, repr=False)


def normalize_row(source: str, data: dict[str, Any], limits: Limits = DEFAULT) -> Row:
    """Validate ``data`` and return its :class:`Row`; a bad row raises :class:`InputError`, as
    does one past a bound of ``limits`` (:mod:`producer.limits`).

    This runs once per row of every enqueue, so a row without options or extra fields costs a
    dictionary lookup per field, not a call (and plain messages one look for deeper values).
    """
    for name, value in data.items():  # before anything recursive (orjson, jsonschema) sees it
        if isinstance(value, dict | list | tuple) and not (name == "messages" and _plain_chat(value)):
            if (too_deep := depth_problem(value, limits)) is not None:
                raise InputError(source, f'"{name}" {too_deep}')
    row = _without_nulls(data)
    if "custom_id" in row and "body" in row:
        row = _batch_row(source, row)
    messages = _messages(source, row)
    messages_json = to_json(source, "messages", messages, orjson.OPT_SORT_KEYS)
    if len(messages_json) > limits.prompt_bytes:
        why = f"above {limits.prompt_bytes} (TOKENMILL_INPUT_MAX_PROMPT_BYTES)"
        raise InputError(source, f"the prompt is {len(messages_json)} bytes as JSON, {why}")
    get = row.get
    record_id, max_tokens = get("id"), get("max_tokens")
    if record_id is not None:
        record_id = _record_id(source, record_id)
    if "max_completion_tokens" in row:
        max_tokens = _max_completion_tokens(source, max_tokens, row["max_completion_tokens"])
    if max_tokens is not None:
        max_tokens = _max_tokens(source, max_tokens)
        check_max_tokens(source, '"max_tokens"', max_tokens, limits)
    options, extra = _split_fields(source, row, limits) if len(row) > 1 else ({}, None)
    metadata = _metadata(source, get("metadata"), extra) if extra or "metadata" in row else {}
    return Row(
        messages,
        record_id,
        max_tokens,
        metadata,
        options,
        messages_json,
        to_json(source, "metadata", metadata) if metadata else b"{}",
    )


def _split_fields(source: str, row: dict[str, Any], limits: Limits) -> tuple[dict[str, Any], dict[str, Any]]:
    """The row's request options (checked) and its other fields (metadata)."""
    options: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name, value in row.items():
        if name in ROW_FIELDS:
            continue
        if name in _OPTION_LIKE:
            options[name] = check_option(source, name, value, limits)
        else:
            extra[name] = value
    if options.get("n") == 1:
        del options["n"]
    return options, extra


def _batch_row(source: str, row: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Batch API line as the row its body is: ``custom_id`` is the id; the body's
    ``model`` goes to metadata (the server's model is the run's)."""
    url, method, body = row.get("url"), row.get("method", "POST"), row["body"]
    if url != BATCH_URL:
        raise InputError(source, f"OpenAI batch line has url {_show(url)}; tokenmill runs {BATCH_URL} only")
    if method != "POST":
        raise InputError(source, f'OpenAI batch line has method {_show(method)}; expected "POST"')
    if not isinstance(body, dict):
        raise InputError(source, f'OpenAI batch line: "body" must be an object, got {json_kind(body)}')
    custom_id = row["custom_id"]
    if not isinstance(custom_id, str) or _blank(custom_id):
        problem = f'"custom_id" must be a non-empty string, got {_show(custom_id)}'
        raise InputError(source, f"OpenAI batch line: {problem}")
    for name in ("id", "metadata"):
        if name in body:
            raise InputError(source, f'OpenAI batch line: "body" has {name!r}, which is not a request field')
    out = _without_nulls(body)
    model = out.pop("model", None)
    out["id"] = custom_id
    extra = {k: v for k, v in row.items() if k not in BATCH_FIELDS}
    if model is not None:
        extra["model"] = model
    if extra:
        out["metadata"] = extra
    return out


# --- messages ------------------------------------------------------------------------------------


def _messages(source: str, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat list from ``messages`` or ``prompt`` (exactly one of them)."""
    has_messages, has_prompt = "messages" in row, "prompt" in row
    if has_messages and has_prompt:
        raise InputError(source, 'has both "messages" and "prompt"; give only one')
    if has_prompt:
        return [{"role": "user", "content": _prompt(source, row["prompt"])}]
    if not has_messages:
        fields = ", ".join(repr(k) for k in sorted(row)) or "none"
        raise InputError(
            source,
            'expected "messages" (a list of chat messages) or "prompt" (a string); '
            f"the row has neither (its fields: {fields})",
        )
    messages = row["messages"]
    if not isinstance(messages, list):
        kind = json_kind(messages)
        raise InputError(source, f'"messages" must be a list of messages, got {kind}')
    if not messages:
        raise InputError(source, '"messages" is an empty list')
    return [_message(source, i, m) for i, m in enumerate(messages)]


def _plain_chat(messages: Iterable[Any]) -> bool:
    """Only messages of a role and a string content: nothing nests deeper (walking them cost a
    third of the time a row takes; this an eighth of that)."""
    for m in messages:
        if type(m) is not dict or len(m) != 2 or type(m.get("content")) is not str:
            return False
    return True


def _prompt(source: str, prompt: Any) -> str:
    if not isinstance(prompt, str):
        raise InputError(source, f'"prompt" must be a string, got {json_kind(prompt)}')
    if _blank(prompt):
        raise InputError(source, '"prompt" is empty')
    return prompt


def _message(source: str, index: int, message: Any) -> dict[str, Any]:
    """One validated message, null-valued keys dropped, extra keys kept."""
    if not isinstance(message, dict):
        raise InputError(source, f"messages[{index}] must be an object, got {json_kind(message)}")
    out = _without_nulls(message)
    role = out.get("role")
    if role not in ROLES:
        where = f"messages[{index}]"
        if role is None:
            raise InputError(source, f'{where} has no "role"')
        raise InputError(
            source, f"{where} has unknown role {_show(role)}; expected one of {', '.join(ROLES)}"
        )
    content = out.get("content")
    if not isinstance(content, str) or _blank(content):  # the common case skips the call
        if role == "assistant" and out.get("tool_calls") and not content:
            return _tool_call_message(source, index, out)
        out = {**out, "content": _content(source, f"messages[{index}] ({role})", content)}
    return out


def _tool_call_message(source: str, index: int, message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn that only called tools (no content), as tool-use conversations have."""
    calls = message["tool_calls"]

    def named(call: Any) -> bool:
        fn = call.get("function") if isinstance(call, dict) else None
        return isinstance(fn, dict) and isinstance(fn.get("name"), str)

    if not isinstance(calls, list) or not all(named(c) for c in calls):
        shape = '{"id", "type": "function", "function": {"name", "arguments"}}'
        raise InputError(source, f'messages[{index}] (assistant) "tool_calls" must be a list of {shape}')
    return {k: v for k, v in message.items() if k != "content"}


def _content(source: str, where: str, content: Any) -> str | list[dict[str, Any]]:
    """A non-blank string, or a non-empty list of text parts (kept as a list)."""
    if content is None:
        raise InputError(source, f'{where} has no "content"')
    if isinstance(content, str):
        if _blank(content):
            raise InputError(source, f"{where} has empty content")
        return content
    if isinstance(content, list):
        if not content:
            raise InputError(source, f"{where} has empty content (an empty list of parts)")
        return [_text_part(source, f"{where} content[{i}]", p) for i, p in enumerate(content)]
    problem = f"{where} content must be a string or a list of text parts, got {json_kind(content)}"
    raise InputError(source, problem)


def _without_nulls(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without its null-valued keys; ``obj`` itself (not copied) when it has none."""
    if None in obj.values():
        return {k: v for k, v in obj.items() if v is not None}
    return obj


def _blank(text: str) -> bool:
    """Empty or only whitespace, without copying the text as ``strip()`` would."""
    return not text or text.isspace()


def _text_part(source: str, where: str, part: Any) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise InputError(source, f"{where} must be an object, got {json_kind(part)}")
    out = _without_nulls(part)
    if out.get("type") != "text":
        raise InputError(source, f"{where} has type {_show(out.get('type'))}; only text parts are accepted")
    text = out.get("text")
    if not isinstance(text, str) or _blank(text):
        raise InputError(source, f"{where} has empty text")
    return out


# --- scalar fields (called only for values present: absent ones cost no call) -------------------


def _record_id(source: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InputError(source, f'"id" must be a string or an integer, got {_show(value)}')
    if isinstance(value, str) and _blank(value):
        raise InputError(source, '"id" is an empty string')
    return str(value)


def _max_tokens(source: str, value: Any, name: str = "max_tokens") -> int:
    if not _is_int(value) or value <= 0:
        raise InputError(source, f'"{name}" must be a positive integer, got {_show(value)}')
    return int(value)


def _max_completion_tokens(source: str, max_tokens: Any, value: Any) -> int:
    """``max_completion_tokens`` (OpenAI's newer name) is ``max_tokens``; both must agree."""
    if max_tokens is not None and max_tokens != value:
        both = f'"max_tokens" ({_show(max_tokens)}) and "max_completion_tokens" ({_show(value)})'
        raise InputError(source, f"{both} disagree")
    return _max_tokens(source, value, "max_completion_tokens")


# --- metadata ------------------------------------------------------------------------------------


def _metadata(source: str, given: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as given, plus every other top-level field under its own name."""
    given = {} if given is None else given
    if not isinstance(given, dict):
        raise InputError(source, f'"metadata" must be an object, got {json_kind(given)}')
    if not extra:
        return given
    for name in extra:
        if name in given:
            raise InputError(
                source,
                f'field {name!r} is both a top-level field and a key of "metadata"; rename one',
            )
    return {**given, **extra}
