"""Admission's window rule as a pure function (workers/admission/policy.py), without Redis: a trace
recorded from the admission benchmark replays to the same decisions, and garbage is clamped.
The rules one by one, through Redis and the watcher, are in tests/test_admission.py."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import orjson
import pytest

from workers.admission import policy

# TOKENMILL_ADMISSION_TRACE=FILE bench/admission.py --matrix base,mixed-outputs --only admission
# --repeat 1 --step-ms 4 (the sim; 2026-12-06): every decision of the two runs' watchers
TRACE = Path(__file__).parent / "data" / "admission-trace.jsonl"
KNOBS = policy.Knobs(
    queue_target=4, queue_share=0.1, backoff=0.75, hold_ms=5000, ceiling=0.95, smallest=2,
    fresh_ms=3000, reserve=0.6, guard=0.9, group=2,
)  # fmt: skip


# the queue rule's knobs as the limiter builds them (workers/admission/limiter.py, QUEUE_RULE_*)
QUEUE = dataclasses.replace(KNOBS, rule="queue", queue_share=0.5, backoff=0.9, hold_ms=1000)


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
    report = policy.Report(running=0, waiting=0, used=0, capacity=4000, retractions=-1)
    decided = policy.steer(report, KNOBS, {}, [], now_ms=1_000)
    assert decided.window == 2
    assert "window" not in decided.fields and decided.fields["young_fit"] == -1


@pytest.mark.parametrize("knobs", [KNOBS, QUEUE], ids=["window", "queue"])
@pytest.mark.parametrize("garbage", ["abc", "nan", "inf", "-inf", "1e400", str(2**64)])
def test_garbage_stored_or_reported_reads_as_the_fields_default(garbage: str, knobs: policy.Knobs) -> None:
    stored = dict.fromkeys(policy.FIELDS, garbage.encode())
    report = policy.Report(running=math.nan, waiting=-3, used=math.inf, capacity=4000, retractions=math.nan)
    decided = policy.steer(report, knobs, stored, [(garbage, garbage)], now_ms=1_000)
    assert 2 <= decided.window <= policy.INT_MAX
    assert all(math.isfinite(v) for v in decided.fields.values())


def test_a_retraction_backs_off_once_and_holds() -> None:
    # Given a window of 20 with 20 in flight at a projected peak of 300 each on a 4,000 pool
    stored = {"window": b"20", "window_ms": b"900", "n": b"20", "total": b"6000", "srv_retractions": b"0"}
    report = policy.Report(running=18, waiting=2, used=3900, capacity=4000, retractions=1)
    # When the server reports its first retraction
    backed = policy.steer(report, KNOBS, stored, [], now_ms=1_000)
    # Then the window backs off to 3/4 of what is on the server (15; 12 would fit at their peaks)
    # and holds for hold_ms
    assert backed.window == 15 and backed.fields["hold_until"] == 6_000 and backed.fields["backoffs"] == 1
    # and the same figures again (the server's figures lag) move nothing during the hold
    again = policy.steer(report, KNOBS, {**stored, **encode(backed.fields)}, [], now_ms=1_500)
    assert again.window == 15 and "hold_until" not in again.fields


def encode(fields: dict[str, float]) -> dict[str, bytes]:
    return {k: str(v).encode() for k, v in fields.items()}


def figures(running: float, waiting: float = 0, used: float = 2000, retractions: float = 0) -> policy.Report:
    return policy.Report(running=running, waiting=waiting, used=used, capacity=4000, retractions=retractions)


# a fresh window of 20, all in flight, a refusal since the last figures (the window limits)
LIMITING = {"window": b"20", "window_ms": b"900", "n": b"20", "refused": b"3", "refused_seen": b"1"}
LIMITING |= {"srv_retractions": b"0", "srv_waiting": b"0"}


def test_the_queue_rule_starts_at_what_the_guard_lets_in_at_the_projected_peak_and_a_queue() -> None:
    # Given 10 requests in flight at a projected peak of 225 tokens each on a 4,000-token pool
    decided = policy.steer(figures(10), QUEUE, {"n": b"10", "total": b"2250"}, [], now_ms=1_000)
    # Then the window is the guard's 0.9 x 4,000 / 225 = 16, plus a queue of max(4, 10 / 2) = 5,
    # and nothing is paced: the server's scheduler decides what runs
    assert decided.window == 21
    assert (decided.fields["bound"], decided.fields["pace_ms"], decided.fields["young_fit"]) == (0, 0, -1)


def test_the_queue_rule_grows_by_the_servers_queue_shortfall_only_while_the_window_limits() -> None:
    # 19 running and 1 waiting: the queue's target is max(4, 19 / 2) = 10, 9 short
    assert policy.steer(figures(19, waiting=1), QUEUE, LIMITING, [], now_ms=1_000).window == 29
    # not while nothing was refused since the last figures, nor while KV use is above the ceiling
    idle = {**LIMITING, "refused_seen": b"3"}
    assert policy.steer(figures(19, waiting=1), QUEUE, idle, [], now_ms=1_000).window == 20
    assert policy.steer(figures(19, 1, used=3900), QUEUE, LIMITING, [], now_ms=1_000).window == 20


def test_a_queue_deeper_than_the_target_twice_shrinks_the_window_to_running_and_the_target() -> None:
    stored = {**LIMITING, "window": b"40", "srv_waiting": b"15"}
    assert policy.steer(figures(16, waiting=14), QUEUE, stored, [], now_ms=1_000).window == 16 + 8
    # once (a burst the scheduler has not taken in yet) it moves nothing
    once = {**stored, "srv_waiting": b"0"}
    assert policy.steer(figures(16, waiting=14), QUEUE, once, [], now_ms=1_000).window == 40


def test_the_queue_rule_backs_off_on_a_retraction_and_holds() -> None:
    # Given a window of 30, 20 running and 10 waiting, when the server reports a new retraction
    backed = policy.steer(figures(20, 10, 3990, retractions=1), QUEUE, LIMITING, [], now_ms=1_000)
    # Then the window is 0.9 of the 30 on the server, held for two polls
    assert (backed.window, backed.fields["hold_until"], backed.fields["backoffs"]) == (27, 2_000, 1)
    # during which room and refusals grow nothing
    held = {**LIMITING, **encode(backed.fields), "refused": b"9"}
    assert policy.steer(figures(10, used=500, retractions=1), QUEUE, held, [], now_ms=1_500).window == 27
    assert policy.steer(figures(10, used=500, retractions=1), QUEUE, held, [], now_ms=2_500).window > 27


def test_after_a_wave_ends_together_the_queue_rule_keeps_its_window_to_refill_at_once() -> None:
    # Given a window of 20 whose requests started together and ended together: 4 left in flight
    ended = {**LIMITING, "n": b"4", "life_ms": b"1200", "life_dev": b"10", "bound": b"1"}
    decided = policy.steer(figures(4, used=400), QUEUE, ended, [], now_ms=1_000)
    # Then the window stays (admit.lua lets the 16 free places in at once), unpaced
    assert decided.window >= 20 and decided.fields["bound"] == 0 and decided.fields["pace_ms"] == 0
