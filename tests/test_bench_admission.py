"""The admission benchmark's report (bench/admission.py): a placebo, a fixed setting run again under
another name, is judged as admission is and never counts as the fastest fixed setting."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import admission


def test_placebo_n_runs_fixed_n_under_its_own_name() -> None:
    args = argparse.Namespace(only="fixed32,placebo32,admission", kv=4000, mean_output=200, high=64, low=8)
    chosen = admission.variants(args)
    assert [(label.split(" (")[0], kind, n) for label, kind, n in chosen] == [
        ("fixed 32", "fixed", 32),
        ("placebo", "fixed", 32),
        ("admission", "admission", 64),
    ]


def test_a_placebo_faster_than_every_fixed_setting_is_judged_not_taken_as_the_fastest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = argparse.Namespace(
        cell="base", outputs="max", mean_output=None, engine="sim", prompts=96, prompt_style="short",
        kv=4000, max_tokens=200, workers=1, warm=False, repeat=2,
    )  # fmt: skip

    def runs(*walls: float) -> list[dict[str, float]]:
        return [{"wall_s": w, "retractions": 0, "mean_running": 16.0} for w in walls]

    results = {
        "fixed 32": runs(10.0, 10.0),
        "fixed 64": runs(11.0, 11.0),
        "placebo (fixed 32 again)": runs(9.0, 9.0),
        "admission (threads 64, no tuning)": runs(10.4, 10.6),
    }
    admission.report(args, results)
    out = capsys.readouterr().out
    assert "placebo / fastest fixed (fixed 32) = 0.900" in out
    assert "admission / fastest fixed (fixed 32) = 1.050, retractions 0 vs 0: meets target" in out
    assert "paired by round: placebo / fixed 32 in the same round = median 0.900" in out
