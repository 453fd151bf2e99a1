"""The Python API doc's two-step example, run as written: answers for a small dataset, then a
judging prompt per answer into a second run, each waited for, the two joined by id, on the sim
with real celery worker processes. The block is read from docs/python-api.md; only the environment
points the client at the test's Redis and sim. And a ``datasets.Dataset`` in, a Dataset out."""

from __future__ import annotations

import re
from pathlib import Path

import datasets
import pytest

import tokenmill
from tests.pipeline import cli, expected_for, read_export, without_nulls
from tests.procs import ROOT, Proc, start_sim, start_worker, worker_env

MEAN = 40  # the sim's mean output tokens (tests.procs.start_sim)


def two_step_block() -> str:
    """docs/python-api.md's Python block that enqueues a second run from the first one's answers."""
    doc = (ROOT / "docs" / "python-api.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "judging" in b]
    assert len(blocks) == 1, "docs/python-api.md has no (or several) two-step blocks"
    return blocks[0]


def test_the_python_api_docs_two_step_example_generates_judges_and_joins_by_id(
    tmp_path: Path, redis_url: str, procs: list[Proc], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the sim and a real short-queue worker, and the client's settings in the environment
    sim, url = start_sim(tmp_path)
    procs.append(sim)
    env = worker_env(redis_url, url)
    procs.append(start_worker(tmp_path, "short", env, concurrency=8))
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    # When the doc's block runs
    scope: dict[str, object] = {}
    exec(compile(two_step_block(), "docs/python-api.md (two-step example)", "exec"), scope)

    # Then every question has one answer and one judgment, joined by its id
    joined = scope["joined"]
    assert sorted(joined["id"]) == sorted(f"q{i}" for i in range(20))  # type: ignore[index]
    tm = tokenmill.Client()
    answers = {row["id"]: row for row in tm.results("answers")}
    judgments = {row["id"]: row for row in tm.results("judgments")}
    assert len(answers) == len(judgments) == 20
    for row in joined.itertuples():  # type: ignore[attr-defined]
        answer, judgment = answers[row.id], judgments[row.id]
        # each is the sim's text for its own request: the judging prompt quotes the answer
        assert row.answer == answer["messages"][-1]["content"]
        assert row.verdict == judgment["messages"][-1]["content"]
        assert f"Answer: {row.answer}\n" in judgment["messages"][0]["content"]
        assert (
            row.answer
            == expected_for(answer, max_tokens=10240, reasoning=False, mean_output_tokens=MEAN).content
        )
        assert (
            row.verdict
            == expected_for(judgment, max_tokens=1024, reasoning=False, mean_output_tokens=MEAN).content
        )
    for run in ("answers", "judgments"):
        assert tm.status(run).totals == {"queued": 0, "running": 0, "done": 20, "failed": 0, "total": 20}


def test_a_dataset_in_and_a_dataset_out_with_real_workers_are_the_exports_rows(
    tmp_path: Path, redis_url: str, procs: list[Proc]
) -> None:
    # Given a datasets.Dataset of prompts, the sim and a real worker
    sim, url = start_sim(tmp_path)
    procs.append(sim)
    env = worker_env(redis_url, url)
    procs.append(start_worker(tmp_path, "short", env, concurrency=8))
    prompts = datasets.Dataset.from_list([{"id": f"p{i}", "prompt": f"Say {i} in words."} for i in range(30)])

    # When it is enqueued, waited for and read back as a Dataset
    tm = tokenmill.Client(redis_url=redis_url, server_url=url)
    assert tm.enqueue(prompts, run="ds", partition="train", short_max_tokens=256).new == 30
    final = tm.wait("ds", timeout=120)
    completions = tm.to_dataset("ds", include_truncated=True)

    # Then it holds the rows `tokenmill export` writes, in its order
    cli("export", "--run", "ds", "--out", str(tmp_path / "out"), "--include-truncated", env=env)
    exported = read_export(tmp_path / "out")["train"]
    assert final.totals["done"] == 30 and len(completions) == 30
    assert [without_nulls(row) for row in completions] == exported
    assert [row["id"] for row in completions] == [f"p{i}" for i in range(30)]
