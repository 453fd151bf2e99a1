"""The quality gate: agreement figures, and check-quality on real sim servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from server_mgr.cli import server
from server_mgr.quality import compare, load_prompts, words
from tests.server_fixtures import sim_server, write_config
from tokenmill.errors import InputError


def test_agreement_figures_of_two_output_lists() -> None:
    result = compare([" a b c d", " a b", ""], [" a b x d", " a b", ""], threshold=0.9)
    assert result.exact_match_rate == pytest.approx(2 / 3)
    assert result.mean_prefix_fraction == pytest.approx((0.5 + 1 + 1) / 3)
    assert (result.median_first_divergence_words, result.diverged, result.passed) == (2, 1, False)
    assert words(" a  b\n") == [" a", "  b", "\n"]


def test_prompts_file_takes_prompt_or_messages_and_names_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert load_prompts(path) == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    path.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    with pytest.raises(InputError, match=r"p.jsonl:2: expected an object with 'messages'"):
        load_prompts(path)


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"Question {i}: why is the sky blue?"}) + "\n" for i in range(6))
    )
    return path


def _invoke(reference: Path, candidate: Path, prompts: Path, *extra: str) -> Result:
    args = ["check-quality", "--reference", str(reference), "--candidate", str(candidate)]
    return CliRunner().invoke(server, [*args, "--prompts", str(prompts), *extra])


def _check(reference: Path, candidate: Path, prompts: Path) -> tuple[int, str]:
    result = _invoke(reference, candidate, prompts, "--max-tokens", "24", "--json")
    return result.exit_code, result.output


def test_identical_configs_pass(tmp_path: Path, prompts: Path) -> None:
    table = sim_server(tmp_path, sim={"step_ms": 1.0})
    reference = write_config(tmp_path / "ref.toml", table)
    candidate = write_config(tmp_path / "cand.toml", {**table, "name": "cand"})
    code, output = _check(reference, candidate, prompts)
    report = json.loads(output[output.index("{") :])
    assert code == 0, output
    assert report["exact_match_rate"] == 1.0 and report["passed"] is True


def test_a_perturbed_candidate_fails(tmp_path: Path, prompts: Path) -> None:
    table = sim_server(tmp_path, sim={"step_ms": 1.0})
    reference = write_config(tmp_path / "ref.toml", table)
    perturbed = {**table, "sim": {**table["sim"], "perturb": 0.05}}
    candidate = write_config(tmp_path / "cand.toml", perturbed)
    code, output = _check(reference, candidate, prompts)
    report = json.loads(output[output.index("{") :])
    assert code == 1, output
    assert report["mean_prefix_fraction"] < 0.95 and report["passed"] is False
    assert report["median_first_divergence_words"] is not None


def test_a_lossy_candidate_is_refused_before_anything_is_launched(tmp_path: Path, prompts: Path) -> None:
    table = sim_server(tmp_path)
    reference = write_config(tmp_path / "ref.toml", table)
    candidate = write_config(tmp_path / "cand.toml", {**table, "kv_cache_dtype": "fp8_e4m3"})
    result = _invoke(reference, candidate, prompts)
    assert result.exit_code != 0
    assert "degrades output quality" in str(result.exception)
    assert not (tmp_path / "logs").exists()
