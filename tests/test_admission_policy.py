"""Admission's window rule as a pure function (workers/admission/policy.py), without Redis: a trace
recorded from the admission benchmark replays to the same decisions, and garbage is clamped.
The rules one by one, through Redis and the watcher, are in tests/test_admission.py."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import orjson
import pytest

from tokenmill.server_report import Load
from workers.admission import policy

# TOKENMILL_ADMISSION_TRACE=FILE bench/admission.py --matrix base,mixed-outputs --only admission
# --repeat 1 --step-ms 4 --step-ms-per-req 0.05 (the sim; 2026-12-07): every decision of the two
# runs' watchers
TRACE = Path(__file__).parent / "data" / "admission-trace.jsonl"
KNOBS = policy.Knobs(
    queue_target=4, queue_share=0.1, backoff=0.75, hold_ms=5000, ceiling=0.95, smallest=2,
    fresh_ms=3000, reserve=0.6, guard=0.9, group=2,
)  # fmt: skip


def trace() -> list[dict[str, object]]:
    return [orjson.loads(line) for line in TRACE.read_bytes().splitlines()]


def test_a_recorded_trace_replays_to_the_same_windows_and_fields() -> None:
    lines = trace()
    for i, line in enumerate(lines):
        decided = policy.replay(line)
        assert (i, decided.window, decided.fields) == (i, line["window"], line["fields"])


def test_the_recorded_trace_exercises_first_windows_growth_pacing_and_the_young_fit() -> None:
    # Given the trace the replay test checks, Then it holds the rules it is meant to guard: first
    # windows, a window that grew, paced windows and fitted young sizes (a retraction's backoff
    # is tested below: the sim did not retract in these runs)
    lines = trace()
    windows = [int(line["window"]) for line in lines]  # type: ignore[call-overload]
    assert any(line["stored"]["window"] is None for line in lines)  # type: ignore[index]
    assert any(b > a for a, b in itertools.pairwise(windows))
    assert any(line["fields"]["pace_ms"] > 0 for line in lines)  # type: ignore[index]
    assert any(line["fields"]["young_fit"] > 0 for line in lines)  # type: ignore[index]


def test_with_nothing_in_flight_no_window_starts_and_the_figures_are_kept() -> None:
    load = Load(running=0, waiting=0, used_tokens=0, capacity=4000)
    decided = policy.steer(load, -1, KNOBS, {}, [], now_ms=1_000)
    assert decided.window == 2
    assert "window" not in decided.fields and decided.fields["young_fit"] == -1


@pytest.mark.parametrize("garbage", ["abc", "nan", "inf", "-inf", "1e400", str(2**64)])
def test_garbage_stored_or_reported_reads_as_the_fields_default(garbage: str) -> None:
    stored = dict.fromkeys(policy.FIELDS, garbage.encode())
    load = Load(running=math.nan, waiting=-3, used_tokens=math.inf, capacity=4000)  # type: ignore[arg-type]
    decided = policy.steer(load, math.nan, KNOBS, stored, [(garbage, garbage)], now_ms=1_000)
    assert 2 <= decided.window <= policy.INT_MAX
    assert all(math.isfinite(v) for v in decided.fields.values())


def test_a_retraction_backs_off_once_and_holds() -> None:
    # Given a window of 20 with 20 in flight at a projected peak of 300 each on a 4,000 pool
    stored = {"window": b"20", "window_ms": b"900", "n": b"20", "total": b"6000", "srv_retractions": b"0"}
    load = Load(running=18, waiting=2, used_tokens=3900, capacity=4000)
    # When the server reports its first retraction
    backed = policy.steer(load, 1, KNOBS, stored, [], now_ms=1_000)
    # Then the window backs off to 3/4 of what is on the server (15; 12 would fit at their peaks)
    # and holds for hold_ms
    assert backed.window == 15 and backed.fields["hold_until"] == 6_000 and backed.fields["backoffs"] == 1
    # and the same figures again (the server's figures lag) move nothing during the hold
    again = policy.steer(load, 1, KNOBS, {**stored, **encode(backed.fields)}, [], now_ms=1_500)
    assert again.window == 15 and "hold_until" not in again.fields


def encode(fields: dict[str, float]) -> dict[str, bytes]:
    return {k: str(v).encode() for k, v in fields.items()}
