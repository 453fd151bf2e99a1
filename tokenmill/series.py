"""Time series in Redis: bounded streams of numeric points, written a step apart, read as columns.

A series is a Redis stream whose entry ids are the Redis clock's milliseconds (so points from
writers on several hosts share one clock). ``series.lua`` adds a point only when the last one is
at least :data:`MIN_GAP` of a step old, and trims points older than ``keep`` as it adds: a
series holds at most ``keep / (MIN_GAP * step)`` points whatever its writers do. A writer may
also skip a point equal to the last (a finished run, an unchanged state), so a series that does
not move costs nothing.

What each series holds, and who writes it, is :mod:`tokenmill.history`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tokenmill import transitions as t
from tokenmill.ledger import Executor
from tokenmill.replies import pairs, text

if TYPE_CHECKING:
    import redis

MIN_GAP = 0.9  # points are at least this share of a step apart: a writer whose period is the step
# (give or take its jitter) adds a point every period
Point = tuple[int, dict[str, float]]  # (Redis clock ms, field -> value)


def encode(value: float) -> str:
    """A value as the stream stores it: integers without a fraction, others to 6 significant
    digits (two equal readings encode the same, so an unchanged point can be skipped)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6g}"


class SeriesWriter:
    """Adds points to series, one step apart, kept for ``keep_s`` (a writer's settings)."""

    def __init__(self, client: redis.Redis, step_s: float, keep_s: float) -> None:
        self.ledger = Executor(client)
        self.gap_ms = int(step_s * MIN_GAP * 1000)
        self.keep_ms = int(keep_s * 1000)
        self._last: dict[str, float] = {}  # key -> when this writer last added a point (monotonic)

    def due(self, key: str) -> bool:
        """Whether a point of ``key`` may be due; False spares a round trip when this writer
        added one less than a gap ago (the script decides for points of other writers)."""
        last = self._last.get(key)
        return last is None or (time.monotonic() - last) * 1000 >= self.gap_ms

    def add(
        self,
        key: str,
        fields: Mapping[str, float],
        *,
        skip_same: bool = False,
        gap: bool = True,
        index: tuple[str, str] | None = None,
    ) -> bool:
        """Add a point of ``fields`` (sorted by name) to ``key``; whether it was added. Without
        ``gap``, only ``skip_same`` holds a point back (a series of changes); ``index`` is an
        (index set, member) to register the series in."""
        point = [x for name in sorted(fields) for x in (name, encode(fields[name]))]
        added = self.ledger.call(
            t.series(key, self.gap_ms if gap else 0, self.keep_ms, skip_same, index, point)
        )
        self._last[key] = time.monotonic()  # added or not, the series is up to date a gap long
        return added


def after(ms: int) -> str:
    """The XRANGE start of the points written after millisecond ``ms``: its first entry of the
    next millisecond. (``(ms`` would exclude only the entry ``ms-0``: the others written in the
    same millisecond would come again.)"""
    return str(ms + 1)


def parse_entry(entry: Sequence[Any]) -> Point:
    """A stream entry (id, fields) as a point: the id's milliseconds and the values."""
    raw_id, raw = entry
    ms = int(text(raw_id).partition("-")[0])
    return ms, {text(f): float(text(v)) for f, v in pairs(raw)}


def downsample(points: list[Point], max_points: int, counters: Iterable[str] = ()) -> list[Point]:
    """At most ``max_points`` points: each group of consecutive points becomes one at its last
    time, holding the last value of each counter (cumulative fields, and any field whose name
    starts with a counter name followed by ``:``) and the largest of every other field (a
    gauge's peak is what a chart of a long range must not hide)."""
    if len(points) <= max_points:
        return points
    counting = tuple(counters)

    def is_counter(name: str) -> bool:
        return name in counting or name.partition(":")[0] in counting

    size = math.ceil(len(points) / max_points)
    out: list[Point] = []
    for i in range(0, len(points), size):
        group = points[i : i + size]
        merged: dict[str, float] = {}
        for _, fields in group:
            for name, value in fields.items():
                merged[name] = value if is_counter(name) else max(value, merged.get(name, value))
        out.append((group[-1][0], merged))
    return out


def columns(points: Sequence[Point]) -> dict[str, list[float | None]]:
    """Points as columns: ``t`` (unix seconds) and one list per field, None where a point lacks
    the field (a failure class that appeared later)."""
    out: dict[str, list[float | None]] = {"t": [ms / 1000 for ms, _ in points]}
    for name in sorted({name for _, fields in points for name in fields}):
        out[name] = [fields.get(name) for _, fields in points]
    return out
