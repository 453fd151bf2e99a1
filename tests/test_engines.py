"""tests.engines' own guards, on the sim: what keeps the real-SGLang tier honest."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.engines import assert_not_the_sim, running_engine


def test_an_engine_started_as_sglang_that_turns_out_to_be_the_sim_fails_loudly(tmp_path: Path) -> None:
    # Given the sim, running with an API key as the real engines are
    with running_engine("sim", tmp_path, api_key="k") as sim:
        # When the check each real SGLang start runs is run on it, as if it had been started as SGLang
        with pytest.raises(AssertionError) as unmasked:
            assert_not_the_sim(replace(sim, kind="sglang"))

    # Then it fails, saying which engine and why
    assert f"the engine started as real SGLang on {sim.url} is not SGLang" in str(unmasked.value)
    assert "GET /_sim/stats answered 200" in str(unmasked.value)
