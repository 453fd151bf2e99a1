"""A job's output judged as it commits: the per-job quality flags, and the stop rules on their rates.

:func:`flags` returns a bit mask over :data:`SIGNALS` (bit i = ``SIGNALS[i]``) from the result the
worker commits and the job's request; the ledger (``commit.lua``) counts the masks per run and
partition and applies the run's rules (:func:`parse_rule`) to the rates over a window of them.
Pure functions, no I/O: what the text says, never a second pass over it.

Repetition is judged by :func:`loop_share`, measured on 16 KB texts with ``.venv/bin/python -m
timeit -s 'from tokenmill.quality import loop_share; t = open("docs/architecture.md").read()[:16384]'
'loop_share(t)'``: 5.5-6.7 µs on that prose; 19-21 µs on a loop (its first 4 KB, then a 49-character
sentence over and over: ``t = (t[:4096] + "I am sorry, but I cannot help with that request. " *
400)[:16384]``), on a shared 2-core machine under load (a bare call ``f()`` took 69 ns there).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import orjson

from tokenmill.errors import ConfigError
from tokenmill.lengths import edge

SIGNALS = ("length", "empty", "repetition", "invalid_structured", "tool_call_errors", "length_drift")
LENGTH, EMPTY, REPETITION, INVALID_STRUCTURED, TOOL_CALL_ERRORS, LENGTH_DRIFT = (1 << i for i in range(6))
# the rates a rule may name, and the flag each is the rate of
RATE_NAMES: dict[str, str] = {"length_share": "length", "empty_share": "empty", **{s: s for s in SIGNALS[2:]}}
DRIFT = "drift"  # judged against the reference, not per job (tokenmill's scorer)
RULE_NAMES = (*RATE_NAMES, DRIFT)

REPETITION_SHARE = 0.3  # a job is flagged when its loop covers at least this share of its output
LOOP_COPIES = 3  # a loop is a block repeated back to back at least this many times...
# ...over at least this many characters (an ellipsis, a "-----" rule are no loop); with it, the
# anchor lies within the loop one block before the end (3 copies of 16 or more are 32 + 16)
LOOP_MIN_CHARS = 48
_ANCHOR = 32  # the text's last characters looked for earlier in it
_TRIES = 64  # earlier occurrences of the anchor tried as the block's length
MIN_HISTOGRAM_JOBS = 200  # LengthBounds need this many jobs' lengths
LOW_Q, HIGH_Q = 0.01, 0.99
DEFAULT_MIN_JOBS = 20  # a rule without @N: judged jobs before it may trip
SCHEMAS_CACHED = 256


def loop_share(text: str) -> float:
    """The share of ``text`` covered by its end's loop: the longest end of the text that is one
    block repeated back to back at least three times (the first and last copies may be partial),
    when that end is at least 48 characters long; 0 when it has none.

    The block's length is where the text's last 32 characters occurred before (``rfind``; up to
    64 earlier occurrences are tried, a long block's first by the anchor two blocks back), and
    the loop's extent a binary search on slice equality: the end of length L repeats a block of
    length p when ``text[-L:-p]`` ends the text (each look compares only the characters the last
    did not, so a loop costs one pass over it).
    """
    n = len(text)
    if n < LOOP_MIN_CHARS:
        return 0.0
    anchor = text[n - _ANCHOR :]
    best = 0
    end = n - 1
    for _ in range(_TRIES):
        at = text.rfind(anchor, 0, end)
        if at < 0:
            break
        p = n - _ANCHOR - at
        if LOOP_COPIES * p > n:
            break
        three = p < _ANCHOR or text.startswith(anchor, n - _ANCHOR - 2 * p)  # (cheap first look)
        covered = _periodic_end(text, p) if three else 0
        best = max(best, covered)
        # a longer loop's block is longer than covered - p: an end with both periods over
        # p + q characters would have their gcd as a period too (Fine and Wilf), and loop further
        end = min(at, n - covered + p - _ANCHOR) + _ANCHOR - 1
    return best / n if best >= LOOP_MIN_CHARS else 0.0


def _periodic_end(text: str, p: int) -> int:
    """The length of the longest end of ``text`` that repeats with period ``p``, when it holds
    ``LOOP_COPIES`` copies of its block; else 0."""
    n = len(text)

    def repeats(known: int, length: int) -> bool:  # the end of ``known`` repeats: that of ``length``?
        return text.startswith(text[n - length + p : n - known + p], n - length)

    lo = LOOP_COPIES * p
    if not repeats(p, lo):
        return 0
    hi = n + 1  # the end of lo repeats, that of hi is past the text
    while hi - lo > 1:  # each look compares only the characters between lo and mid
        mid = (lo + hi) // 2
        if repeats(lo, mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True, slots=True)
class LengthBounds:
    """The run's own completion lengths so far: tokens in ``[lo, hi)`` are usual (p1 to p99)."""

    lo: int
    hi: int

    @classmethod
    def from_histogram(cls, counts: Mapping[int, int]) -> LengthBounds | None:
        """The bounds from a completion-length histogram (jobs per bin of :mod:`tokenmill.lengths`,
        the outputs hash's ``c<bin>`` fields): from the lower edge of the bin holding the 1st
        percentile to the upper edge of the bin holding the 99th; None below 200 jobs."""
        total = sum(counts.values())
        if total < MIN_HISTOGRAM_JOBS:
            return None
        bins = sorted(counts)
        seen = list(itertools.accumulate(counts[b] for b in bins))  # jobs in the bins up to each
        lo_bin, hi_bin = (bins[bisect.bisect_left(seen, q * total)] for q in (LOW_Q, HIGH_Q))
        return cls(edge(lo_bin), edge(hi_bin + 1))

    def outside(self, tokens: int) -> bool:
        return not self.lo <= tokens < self.hi


def flags(result: Mapping[str, Any], request: Mapping[str, Any], bounds: LengthBounds | None) -> int:
    """The job's quality flags, a bit mask over :data:`SIGNALS`, from the ``result`` the worker
    commits (``content``, ``reasoning_content``, ``tool_calls``, ``finish_reason``, ``usage``)
    and the job's ``request``: ``length`` (finish reason ``length``), ``empty`` (no answer: blank
    content and no tool call, reasoning or not), ``repetition`` (:func:`loop_share` of the output
    at least :data:`REPETITION_SHARE`), ``invalid_structured`` (the content fails its
    ``response_format`` or ``regex``; ebnf is not judged), ``tool_call_errors`` (a call of an
    undeclared tool, or arguments that are not JSON or fail the tool's ``parameters``) and
    ``length_drift`` (completion tokens outside ``bounds``)."""
    content = result.get("content") or ""
    calls = result.get("tool_calls") or ()
    usage = result.get("usage") or {}
    judged = (  # in the order of SIGNALS
        result.get("finish_reason") == "length",
        not calls and not content.strip(),
        loop_share((result.get("reasoning_content") or "") + content) >= REPETITION_SHARE,
        not structured_ok(content, request),
        "tools" in request and not tool_calls_ok(calls, request["tools"]),
        bounds is not None and bounds.outside(int(usage.get("completion_tokens") or 0)),
    )
    return sum(1 << i for i, flagged in enumerate(judged) if flagged)


def structured_ok(content: str, request: Mapping[str, Any]) -> bool:
    """Whether ``content`` holds to the request's ``response_format`` (``json_schema``: valid
    JSON the schema accepts; ``json_object``: a JSON object) and ``regex`` (matched whole);
    True for a request with neither."""
    fmt = request.get("response_format") or {}
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {"schema": fmt.get("schema")}
        ok, value = _json(content)
        if not ok or not _validator(_canonical(spec.get("schema") or {})).is_valid(value):
            return False
    elif kind == "json_object":
        ok, value = _json(content)
        if not ok or not isinstance(value, dict):
            return False
    pattern = request.get("regex")
    return not pattern or re.fullmatch(pattern, content) is not None


def tool_calls_ok(calls: Any, tools: Any) -> bool:
    """Whether every tool call names a declared tool and its arguments are JSON its
    ``parameters`` schema accepts."""
    declared = {
        t["function"]["name"]: t["function"].get("parameters") for t in tools or () if "function" in t
    }
    for call in calls:
        fn = call.get("function") or {}
        name = fn.get("name")
        if name not in declared:
            return False
        args = fn.get("arguments")
        ok, value = _json(args) if isinstance(args, str) else (isinstance(args, dict), args)
        if not ok:
            return False
        params = declared[name]
        if params and not _validator(_canonical(params)).is_valid(value):
            return False
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(text: str) -> tuple[bool, Any]:
    """``(True, value)`` for a JSON text, ``(False, None)`` otherwise (numbers beyond a double's
    range, which orjson refuses, are JSON)."""
    try:
        return True, orjson.loads(text)
    except orjson.JSONDecodeError:
        try:
            return True, json.loads(text, parse_constant=_reject_constant)
        except ValueError:
            return False, None


def _canonical(schema: Any) -> bytes:
    return orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)


@lru_cache(maxsize=SCHEMAS_CACHED)
def _validator(schema_json: bytes) -> Any:
    """The compiled validator of a schema (its canonical JSON: a run's jobs share a few)."""
    from jsonschema import validators

    schema = orjson.loads(schema_json)
    return validators.validator_for(schema)(schema)


@dataclass(frozen=True, slots=True)
class Rule:
    """A stop rule: trips when the rate ``name`` is above (``op`` ``>``) or below (``<``)
    ``value`` over at least ``min_jobs`` judged jobs."""

    name: str
    op: Literal[">", "<"]
    value: float
    min_jobs: int = DEFAULT_MIN_JOBS

    def trips(self, rate: float | None, judged: int) -> bool:
        """Whether the rule trips on ``rate`` over ``judged`` jobs (None: not measured yet)."""
        if rate is None or judged < self.min_jobs:
            return False
        return rate > self.value if self.op == ">" else rate < self.value

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.value:g}@{self.min_jobs}"


_RULE = re.compile(r"\s*(?P<name>[^<>@\s]*)\s*(?P<op>[<>])\s*(?P<value>[^@]*?)\s*(?:@\s*(?P<n>.*?))?\s*")


def parse_rule(expr: str) -> Rule:
    """``NAME>VALUE`` or ``NAME<VALUE``, optionally ``@N`` (the minimum judged jobs before it may
    trip; :data:`DEFAULT_MIN_JOBS` without), NAME one of :data:`RULE_NAMES`; a
    :class:`~tokenmill.errors.ConfigError` naming ``expr`` and what is wrong with it."""
    m = _RULE.fullmatch(expr)
    where = f"quality rule {expr!r}"
    if m is None:
        raise ConfigError(
            f"{where}: write NAME>VALUE or NAME<VALUE, optionally @N (e.g. repetition>0.05@200)"
        )
    name = m["name"]
    if name not in RULE_NAMES:
        raise ConfigError(f"{where}: unknown signal {name!r}; known: {', '.join(RULE_NAMES)}")
    try:
        value = float(m["value"])
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"{where}: the value {m['value']!r} is not a number")
    n = m["n"]
    if n is not None and not (n.isdigit() and int(n) > 0):
        raise ConfigError(f"{where}: the minimum jobs after @ must be a positive whole number, got {n!r}")
    op: Literal[">", "<"] = ">" if m["op"] == ">" else "<"
    return Rule(name, op, value, int(n) if n is not None else DEFAULT_MIN_JOBS)
