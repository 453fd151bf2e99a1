"""The admission benchmark's correction for this host's drifting speed (bench/_common.py): decode
steps timed from SGLang's millisecond-stamped log, and each run's speed fitted from them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _common import SglangLog, host_speeds


def decode(at: str, running: int) -> str:
    return (
        f"[2026-12-05 22:13:{at}] Decode batch, #running-req: {running}, #token: 14, token usage: 0.00, "
        "cpu graph: False, gen throughput (token/s): 330.64, #queue-req: 0\n"
    )


def prefill(at: str) -> str:
    return (
        f"[2026-12-05 22:13:{at}] Prefill batch, #new-seq: 2, #new-token: 24, #cached-token: 0, token "
        "usage: 0.00, #running-req: 16, #queue-req: 0, #pending-token: 0, cpu graph: False\n"
    )


def test_a_decode_step_is_timed_from_the_decode_line_before_it() -> None:
    log = SglangLog.parse(
        decode("36.000", 16)
        + decode("36.009", 16)  # 9 ms
        + prefill("36.020")  # the prefill line is written before its pass: not a step
        + decode("36.040", 18)  # follows a prefill line: the prefill's pass in it
        + decode("36.050", 18)  # 10 ms
        + decode("36.062", 17)  # 12 ms
        + decode("37.500", 17)  # the server idled: not a step
    )
    assert log.decode_running == [16, 16, 18, 18, 17, 17]
    assert set(log.decode_steps) == {16, 17, 18}
    n16, t16 = log.decode_steps[16]
    n18, t18 = log.decode_steps[18]
    n17, t17 = log.decode_steps[17]
    assert (n16, n18, n17) == (1, 1, 1)
    assert (t16, t18, t17) == pytest.approx((0.009, 0.010, 0.012), abs=1e-6)


def test_unstamped_lines_time_no_steps() -> None:
    text = decode("36.000", 16).replace(".000]", "]") + decode("36.009", 16).replace(".009]", "]")
    assert SglangLog.parse(text).decode_steps == {}


def test_runs_of_different_batches_are_compared_batch_size_by_batch_size() -> None:
    # a step costs 3 + 0.4 b ms at speed 1; run 0 (speed 1) runs batches of 16 only, run 1 (1.2x
    # slower) 16 to 24, run 2 (0.9) 20 to 24 only: it shares sizes with run 1, not with run 0
    cost = {b: 3 + 0.4 * b for b in range(16, 25)}
    true = [1.0, 1.2, 0.9]
    sizes = [[16], list(range(16, 25)), list(range(20, 25))]
    steps = [{b: (100, 100 * cost[b] * s / 1000) for b in bs} for s, bs in zip(true, sizes, strict=True)]
    speeds = host_speeds(steps)
    mean = sum(true) / len(true)
    assert speeds == pytest.approx([s / mean for s in true], rel=1e-3)
    # a run's mean step time alone would call run 2 slower than run 0: its batches are bigger
    mean_step = [sum(t for _, t in run.values()) / sum(n for n, _ in run.values()) for run in steps]
    assert mean_step[2] > mean_step[0]
    assert speeds[2] < speeds[0]


def test_a_run_without_timed_steps_counts_as_the_mean_speed() -> None:
    assert host_speeds([{16: (10, 0.09)}, {}]) == [1.0, 1.0]
