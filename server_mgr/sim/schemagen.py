"""A JSON value that conforms to a JSON Schema, drawn deterministically from a seeded RNG.

What the sim answers to ``response_format: json_schema`` and to tool arguments: a real model
under SGLang's grammar writes some value the schema admits; the sim writes one too, the same one
for the same request. It covers the keywords extraction and tool schemas use (types and type
lists, ``enum``/``const``, ``properties``/``required``, ``items``/``prefixItems`` with
``minItems``/``maxItems``/``uniqueItems``, string lengths, ``pattern`` and common ``format``s,
numeric bounds and ``multipleOf``, ``anyOf``/``oneOf``/``allOf``, local ``$ref``); what it does
not know it leaves out, and the tests check every value with ``jsonschema``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import rstr

WORDS = (
    "alpha bravo cache queue token shard lease worker river stone cloud amber delta "
    "north maple cedar orbit pixel quartz sigma tango umbra vivid willow"
).split()
FORMATS = {
    "date": "2024-05-17",
    "date-time": "2024-05-17T10:20:30Z",
    "time": "10:20:30Z",
    "email": "user@example.com",
    "uri": "https://example.com/a",
    "uuid": "123e4567-e89b-12d3-a456-426614174000",
    "ipv4": "192.0.2.1",
    "hostname": "example.com",
}
MAX_DEPTH = 6
EXTRA_ITEMS = 3  # arrays get at most minItems + this many items


class SchemaGen:
    """Values for one root schema (its ``$defs``/``definitions`` resolve local refs)."""

    def __init__(self, root: Mapping[str, Any], rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    def value(self, schema: Any = None, depth: int = 0) -> Any:
        """A value ``schema`` (default: the root) admits."""
        schema = self.root if schema is None else schema
        if schema is True or not isinstance(schema, Mapping):
            return self._string({})
        if "$ref" in schema:
            return self.value(self._resolve(str(schema["$ref"])), depth + 1)
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return self.rng.choice(list(schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if schema.get(key):
                return self.value(self.rng.choice(list(schema[key])), depth + 1)
        if schema.get("allOf"):
            merged: dict[str, Any] = {}
            for part in schema["allOf"]:
                if isinstance(part, Mapping):
                    merged.update(part)
            return self.value({**merged, **{k: v for k, v in schema.items() if k != "allOf"}}, depth + 1)
        return self._typed(schema, self._type(schema), depth)

    def _type(self, schema: Mapping[str, Any]) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            # prefer a non-null type: null carries no data worth checking
            real = [t for t in kind if t != "null"] or kind
            kind = self.rng.choice(real)
        if kind:
            return str(kind)
        if "properties" in schema:
            return "object"
        if "items" in schema or "prefixItems" in schema:
            return "array"
        return "string"

    def _typed(self, schema: Mapping[str, Any], kind: str, depth: int) -> Any:
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema)

    def _resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return {}
        node: Any = self.root
        for part in ref.lstrip("#").strip("/").split("/"):
            if not part:
                continue
            if not isinstance(node, Mapping) or part not in node:
                return {}
            node = node[part]
        return node

    def _object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        out: dict[str, Any] = {}
        for name, sub in props.items():
            if name in required or (depth < MAX_DEPTH and self.rng.random() < 0.5):
                out[name] = self.value(sub, depth + 1)
        for name in required - out.keys():
            out[name] = self._string({})
        return out

    def _array(self, schema: Mapping[str, Any], depth: int) -> list[Any]:
        prefix = list(schema.get("prefixItems") or ())
        low = int(schema.get("minItems", 0))
        high = int(schema.get("maxItems", low + EXTRA_ITEMS))
        n = self.rng.randint(low, max(low, min(high, low + EXTRA_ITEMS)))
        if depth >= MAX_DEPTH:
            n = low
        items = schema.get("items", {})
        out: list[Any] = []
        seen: set[str] = set()
        for _ in range(n * 4):  # uniqueItems: a few draws more, then fewer items
            if len(out) == n:
                break
            sub = prefix[len(out)] if len(out) < len(prefix) else items
            value = self.value(sub, depth + 1)
            mark = repr(value)
            if schema.get("uniqueItems") and mark in seen:
                continue
            seen.add(mark)
            out.append(value)
        return out

    def _integer(self, schema: Mapping[str, Any]) -> int:
        low, high = _bounds(schema, integer=True)
        step = abs(int(schema.get("multipleOf", 1))) or 1
        first = math.ceil(low / step) * step
        return first + step * self.rng.randint(0, max(0, int(high - first) // step))

    def _number(self, schema: Mapping[str, Any]) -> float | int:
        if "multipleOf" in schema:
            multiple: float | int = schema["multipleOf"]
            return self._integer({**schema, "multipleOf": 1}) * multiple
        low, high = _bounds(schema, integer=False)
        return min(max(round(low + (high - low) * self.rng.random(), 2), low), high)

    def _string(self, schema: Mapping[str, Any]) -> str:
        if schema.get("format") in FORMATS:
            return FORMATS[schema["format"]]
        if schema.get("pattern"):
            return rstr.Rstr(self.rng).xeger(schema["pattern"])
        low = int(schema.get("minLength", 1))
        high = int(schema.get("maxLength", max(low, 12)))
        text = ""
        target = self.rng.randint(low, max(low, high))
        while len(text) < target:
            text += (" " if text else "") + self.rng.choice(WORDS)
        return text[:target]


def _bounds(schema: Mapping[str, Any], *, integer: bool) -> tuple[float, float]:
    """[low, high] from ``minimum``/``maximum`` and their exclusive forms (a span of 100 when
    a side is open)."""
    nudge = 1 if integer else 0.01
    low = schema.get("minimum")
    if isinstance(schema.get("exclusiveMinimum"), int | float):
        low = max(low if low is not None else -math.inf, schema["exclusiveMinimum"] + nudge)
    high = schema.get("maximum")
    if isinstance(schema.get("exclusiveMaximum"), int | float):
        high = min(high if high is not None else math.inf, schema["exclusiveMaximum"] - nudge)
    if low is None:
        low = 0 if high is None or high >= 0 else high - 100
    if high is None:
        high = low + 100
    if integer:
        return math.ceil(low), math.floor(high)
    return float(low), float(high)


def generate(schema: Mapping[str, Any], rng: random.Random) -> Any:
    """A value ``schema`` admits, the same one for the same RNG state."""
    return SchemaGen(schema, rng).value()
