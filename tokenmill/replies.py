"""Redis replies as Python values: the one decoder of stored text (light to import: ``status``
and ``runs`` read with it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def text(value: Any) -> str:
    """A Redis reply or stored value as text (bytes decoded; anything else by ``str``)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def pairs(reply: Any) -> Iterable[tuple[Any, Any]]:
    """A hash-like reply's (field, value) pairs: a dict's items, or a flat [field, value, ...] list's."""
    return reply.items() if isinstance(reply, Mapping) else zip(reply[::2], reply[1::2], strict=True)
