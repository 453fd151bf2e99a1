"""Drift against a reference on real SGLang 0.5.23 (CPU, the tiny model): the scorer's teacher
forcing gives the log-probabilities SGLang reports when it generates the same tokens, and a run
on a server with other weights is reported as drifting where the reference judged against
itself is not (workers/reference.py, tokenmill/quality_drift.py).

The other weights: the tiny model's directory with its weights drawn again from another seed
(``scripts/sglang_env/make_model.py``'s ``write_weights``, run by the SGLang venv's torch),
built once per machine beside the model behind a stamp; nothing is downloaded.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.engines import Engine, ready_or_again, sglang_env, start_engine
from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import Proc, start_worker, wait_for, worker_env
from tests.sglang_client import post_json
from tokenmill import quality_drift as qd
from workers.reference import ReferenceServer

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]
OTHER_SEED = 1
JOBS = 12


def other_weights() -> Path:
    """The tiny model with weights of seed ``OTHER_SEED`` (built once per machine)."""
    env = sglang_env()
    out = env.home / f"model-seed{OTHER_SEED}"
    stamp = out / ".built"
    if not stamp.exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(env.model, out)
        script = (
            "import sys; sys.path.insert(0, sys.argv[1]); import make_model as m; "
            f"m.WEIGHT_SEED = {OTHER_SEED}; from pathlib import Path; m.write_weights(Path(sys.argv[2]))"
        )
        subprocess.run(
            [str(env.python), "-c", script, str(ROOT / "scripts" / "sglang_env"), str(out)], check=True
        )
        stamp.write_text("ok\n")
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    """The reference (the tiny model) and a candidate with other weights, side by side."""
    workdir = tmp_path_factory.mktemp("drift")
    other = ("--model-path", str(other_weights()), "--load-format", "safetensors")
    started = [
        start_engine("sglang", workdir, wait_ready=False),
        start_engine("sglang", workdir, *other, wait_ready=False),
    ]
    try:  # side by side: each takes ~20 s of one core to start
        started[0] = ready_or_again(started[0], lambda: start_engine("sglang", workdir))
        started[1] = ready_or_again(started[1], lambda: start_engine("sglang", workdir, *other))
        yield started[0], started[1]
    finally:
        for engine in started:
            engine.stop()


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me about item {i} of the list, in order."}]


def test_teacher_forced_scores_equal_the_logprobs_sglang_reports_while_generating(
    engines: tuple[Engine, Engine],
) -> None:
    reference, _ = engines
    for i in range(3):
        # Given an output the reference generated greedily, with its tokens' logprobs
        status, answer = post_json(reference, "/v1/chat/completions", {
            "messages": prompt(i), "max_tokens": 24, "temperature": 0, "logprobs": True,
            "return_token_ids": True})  # fmt: skip
        assert status == 200, answer
        choice = answer["choices"][0]
        ids, reported = choice["response_token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]
        assert len(ids) == len(reported) > 0

        # When the scorer teacher-forces those tokens after the prompt
        status, scored = post_json(reference, "/generate", {
            "input_ids": choice["prompt_token_ids"] + ids, "return_logprob": True,
            "logprob_start_len": len(choice["prompt_token_ids"]) - 1,
            "sampling_params": {"max_new_tokens": 0}})  # fmt: skip
        assert status == 200, scored

        # Then each token's score is the logprob SGLang reported for it, and so is their mean
        rows = scored["meta_info"]["input_token_logprobs"]
        assert rows[0][0] is None and [r[1] for r in rows[1:]] == ids
        assert [r[0] for r in rows[1:]] == pytest.approx(reported, abs=1e-3)
        forced = ReferenceServer(reference.url, None).teacher_force(choice["prompt_token_ids"], [ids])
        assert forced == [pytest.approx(sum(reported) / len(reported), abs=1e-3)]


def run_judged(
    tmp_path: Path, redis_url: str, procs: list[Proc], run: str, server: Engine, reference: Engine
) -> dict[str, Any]:
    """``run`` of JOBS greedy jobs on ``server``, every job scored on ``reference``: its figures."""
    env = worker_env(redis_url, server.url)
    data = write_jsonl(
        tmp_path / f"{run}.jsonl", [{"id": f"j{i}", "messages": prompt(i)} for i in range(JOBS)]
    )
    cli("enqueue", str(data), "--run", run, "--partition", "P", "--temperature", "0",
        "--short-max-tokens", "24", "--quality-reference", reference.url, "--quality-sample", "1",
        env=env)  # fmt: skip
    worker = start_worker(tmp_path, "short", env, concurrency=4, name=run)
    procs.append(worker)
    client = redis.Redis.from_url(redis_url)
    wait_run_finished(client, run, 240)

    def scored() -> dict[str, dict[str, Any]] | None:
        v = qd.drift_view(client, run)
        return v if v and v["P"]["n"] + v["P"]["skipped"] == JOBS else None

    view = wait_for(scored, 240, f"{run}'s jobs scored")
    worker.stop()
    figures: dict[str, Any] = view["P"]
    return figures


def test_a_server_with_other_weights_drifts_and_the_reference_against_itself_does_not(
    engines: tuple[Engine, Engine], tmp_path: Path, redis_url: str, procs: list[Proc]
) -> None:
    reference, candidate = engines
    # Given a run on the candidate and one on the reference itself, both judged on the reference
    other = run_judged(tmp_path, redis_url, procs, "other", candidate, reference)
    same = run_judged(tmp_path, redis_url, procs, "same", reference, reference)

    # Then the candidate's outputs are far less likely to the reference than its own, beyond
    # the interval; the reference's own outputs are exactly its own (greedy, the same server)
    assert other["error"] is None and other["n"] >= JOBS - 2, other
    assert other["drift"] - other["ci95"] > 0.5, other
    assert same["n"] >= JOBS - 2 and same["drift"] == 0.0 and same["ci95"] == 0.0, same
