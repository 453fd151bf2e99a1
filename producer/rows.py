"""Input rows → normalized requests, validated so that every problem names its row.

A row has ``messages`` (an OpenAI chat list) or ``prompt`` (a string, sent as one user message),
and optionally ``id``, ``max_tokens``, ``metadata`` and the sampling overrides ``temperature``,
``top_p`` and ``seed``. Every other top-level field is kept in ``metadata`` under its own name.

A field whose value is null counts as absent, and null-valued keys inside messages are dropped:
Parquet and Arrow fill fields a row does not have with nulls, and a row must mean the same thing
whichever format it came in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from producer.readers import json_kind
from tokenmill.errors import InputError

ROLES = ("system", "user", "assistant", "tool")
KNOWN_FIELDS = frozenset(
    {"messages", "prompt", "id", "max_tokens", "metadata", "temperature", "top_p", "seed"}
)
_SHOW_CHARS = 60


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
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    messages_json: bytes = field(default=b"", compare=False, repr=False)
    metadata_json: bytes = field(default=b"{}", compare=False, repr=False)


def normalize_row(source: str, data: dict[str, Any]) -> Row:
    """Validate ``data`` and return its :class:`Row`; a bad row raises :class:`InputError`.

    This runs once per row of every enqueue, so absent options cost a dictionary lookup each,
    not a call.
    """
    row = _without_nulls(data)
    messages = _messages(source, row)
    get = row.get
    record_id, max_tokens = get("id"), get("max_tokens")
    if record_id is not None:
        record_id = _record_id(source, record_id)
    if max_tokens is not None:
        max_tokens = _max_tokens(source, max_tokens)
    metadata = _metadata(source, row) if len(row) > 1 else {}
    temperature, top_p, seed = get("temperature"), get("top_p"), get("seed")
    return Row(
        messages,
        record_id,
        max_tokens,
        metadata,
        temperature if temperature is None else _temperature(source, temperature),
        top_p if top_p is None else _top_p(source, top_p),
        seed if seed is None else _seed(source, seed),
        _to_json(source, "messages", messages, orjson.OPT_SORT_KEYS),
        _to_json(source, "metadata", metadata) if metadata else b"{}",
    )


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
        out = {**out, "content": _content(source, f"messages[{index}] ({role})", content)}
    return out


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


def _max_tokens(source: str, value: Any) -> int:
    if not _is_int(value) or value <= 0:
        raise InputError(source, f'"max_tokens" must be a positive integer, got {_show(value)}')
    return int(value)


def _temperature(source: str, value: Any) -> float:
    if not _is_number(value) or value < 0:
        raise InputError(source, f'"temperature" must be a number >= 0, got {_show(value)}')
    return float(value)


def _top_p(source: str, value: Any) -> float:
    if not _is_number(value) or not 0 < value <= 1:
        raise InputError(source, f'"top_p" must be a number in (0, 1], got {_show(value)}')
    return float(value)


def _seed(source: str, value: Any) -> int:
    if not _is_int(value):
        raise InputError(source, f'"seed" must be an integer, got {_show(value)}')
    return int(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


# --- metadata ------------------------------------------------------------------------------------


def _metadata(source: str, row: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` as given, plus every unknown top-level field under its own name."""
    given = row.get("metadata", {})
    if not isinstance(given, dict):
        raise InputError(source, f'"metadata" must be an object, got {json_kind(given)}')
    extra = {k: v for k, v in row.items() if k not in KNOWN_FIELDS}
    for name in extra:
        if name in given:
            raise InputError(
                source,
                f'field {name!r} is both a top-level field and a key of "metadata"; rename one',
            )
    return {**given, **extra} if extra else given


def _to_json(source: str, what: str, value: Any, option: int = 0) -> bytes:
    """Jobs are stored as JSON: refuse values that cannot be (bytes, decimals...) now, by row."""
    try:
        return orjson.dumps(value, option=option)
    except TypeError as exc:
        raise InputError(source, f"{what} cannot be stored as JSON: {exc}") from None


def _show(value: Any) -> str:
    """``repr(value)``, cut short for display in an error message."""
    text = repr(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."
