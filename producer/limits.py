"""Bounds at the door: how big, how deep and how large a number a row or a run option may be.

Checked at enqueue, so that no input crashes the producer (a value nested past orjson's or
Python's stack, a regex of 600 nested groups) or reaches a server it breaks (a ``max_tokens`` of
2^64 - 1 poisons admission; a ``top_k`` past int32 fails the whole batch SGLang builds). Nesting
is measured without recursion, before orjson, jsonschema or ``re.compile`` see the value. Each
check is a pure function returning what is wrong (None: nothing); the callers name the row and
the option (``producer/rows.py``, ``producer/options.py``, ``producer/enqueue.py``). The bounds
are settings (``TOKENMILL_INPUT_MAX_*``), and ``max_tokens`` stays below the context length the
run's servers publish in the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from tokenmill import servers
from tokenmill.errors import InputError
from tokenmill.settings import Settings

if TYPE_CHECKING:
    from tokenmill.quick_redis import ReadClient

INT32_MAX = 2**31 - 1  # SGLang holds top_k and min_new_tokens in int32 tensors
INT64_MAX = 2**63 - 1  # and token ids in int64 ones
_SCHEMA_OPTIONS = ("response_format", "tools")
_REGEX_OPTIONS = ("regex", "stop_regex")


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds one enqueue checks against (see the ``input_max_*`` settings)."""

    row_bytes: int
    prompt_bytes: int
    depth: int
    schema_bytes: int
    regex_chars: int
    regex_depth: int
    max_tokens: int
    max_tokens_why: str  # what sets max_tokens, for the refusal

    @classmethod
    def of(cls, settings: Settings, context: tuple[int, str] | None = None) -> Limits:
        """The settings' bounds; with ``context`` (a server's context length and name), max_tokens
        below that context."""
        if context is None:
            max_tokens, why = settings.input_max_tokens, "TOKENMILL_INPUT_MAX_TOKENS"
        else:
            max_tokens, why = context[0] - 1, f"server {context[1]}'s context length is {context[0]}"
        return cls(
            settings.input_max_row_bytes,
            settings.input_max_prompt_bytes,
            settings.input_max_depth,
            settings.input_max_schema_bytes,
            settings.input_max_regex_chars,
            settings.input_max_regex_depth,
            max_tokens,
            why,
        )


DEFAULT = Limits.of(Settings())


def for_servers(client: ReadClient, settings: Settings) -> Limits:
    """The run's bounds, max_tokens below the shortest context of the servers it sends to, as the
    server manager publishes them for admission (:func:`tokenmill.servers.load_all`)."""
    wanted = set(settings.server_urls)
    records = servers.load_all(client)
    known = [(r.context_length, r.name) for r in records if r.context_length and r.url.rstrip("/") in wanted]
    return Limits.of(settings, min(known) if known else None)


def check_max_tokens(source: str, what: str, value: int, limits: Limits) -> None:
    """``value`` (a row's max_tokens, or a flag's) is at most what a job may ask for."""
    if value > limits.max_tokens:
        raise InputError(source, f"{what} {value} is above {limits.max_tokens} ({limits.max_tokens_why})")


def too_deep(value: Any, levels: int) -> bool:
    """Whether ``value`` (a list or an object: one level) has more than ``levels`` levels of lists
    and objects, measured with a stack of its own rather than Python's."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > levels:
            return True
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, dict | list | tuple):
                stack.append((child, level + 1))
    return False


def depth_problem(value: Any, limits: Limits) -> str | None:
    """Why a field of a row (or a run option) nests too deep: the row itself is one level."""
    if isinstance(value, dict | list | tuple) and too_deep(value, limits.depth - 1):
        return f"nests deeper than {limits.depth} levels (TOKENMILL_INPUT_MAX_DEPTH)"
    return None


def option_problem(name: str, value: Any, limits: Limits) -> str | None:
    """Why an option's value is past a size bound: a schema's bytes, a regex's length or groups.
    Its nesting was checked already (:func:`depth_problem`), so dumping it cannot overflow."""
    if name in _SCHEMA_OPTIONS:
        try:
            size = len(orjson.dumps(value))
        except TypeError as exc:
            return f"cannot be stored as JSON: {exc}"
        if size > limits.schema_bytes:
            return f"is {size} bytes as JSON, above {limits.schema_bytes} (TOKENMILL_INPUT_MAX_SCHEMA_BYTES)"
    elif name in _REGEX_OPTIONS:
        for pattern in [value] if isinstance(value, str) else value if isinstance(value, list) else ():
            if not isinstance(pattern, str):
                continue  # the option's own check refuses it
            if len(pattern) > limits.regex_chars:
                why = "TOKENMILL_INPUT_MAX_REGEX_CHARS"
                return f"has a pattern of {len(pattern)} characters, above {limits.regex_chars} ({why})"
            if (groups := regex_depth(pattern)) > limits.regex_depth:
                why = "TOKENMILL_INPUT_MAX_REGEX_DEPTH"
                return f"has a pattern of {groups} nested groups, above {limits.regex_depth} ({why})"
    return None


def regex_depth(pattern: str) -> int:
    """How deep ``pattern``'s groups nest: parentheses neither escaped nor in a character class.
    It may count a weird class's ``(`` (``[](]``), never miss a group."""
    depth = deepest = 0
    escaped = in_class = False
    for ch in pattern:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
    return deepest
