"""Redis replies as Python values: the one decoder of stored text (light to import: ``status``
and ``runs`` read with it)."""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    """A Redis reply or stored value as text (bytes decoded; anything else by ``str``)."""
    return value.decode() if isinstance(value, bytes) else str(value)
