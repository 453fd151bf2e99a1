"""Drift against a reference server (tokenmill/quality_drift.py, workers/reference.py): the
figures, the sim's ``/generate``, and a run judged on the sim by a real worker."""

from __future__ import annotations

import math
import random
import statistics
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import Proc, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys
from tokenmill import quality_drift as qd
from tokenmill.errors import ConfigError
from tokenmill.local_redis import free_port
from tokenmill.settings import Settings
from workers.reference import ReferenceServer, mean_logprob


def test_drift_is_the_mean_difference_with_a_normal_95_percent_interval() -> None:
    rng = random.Random(5)
    diffs = [rng.gauss(0.3, 0.2) for _ in range(57)]
    d = qd.Drift(len(diffs), sum(diffs), sum(x * x for x in diffs))
    assert d.mean == pytest.approx(statistics.mean(diffs))
    assert d.ci95 == pytest.approx(1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)))
    assert qd.Drift(1, 0.5, 0.25).ci95 is None and qd.Drift().mean is None
    assert qd.Drift(3, 0.0, 0.0).ci95 == 0.0


def test_a_reference_is_an_http_url_and_a_sample_a_fraction() -> None:
    settings = Settings.load({}, quality_sample_min=7)
    assert qd.chosen(settings, None, None) is None
    ref = qd.chosen(settings, "http://ref:30000/", 0.1)
    assert ref is not None and ref.fields() == {"url": "http://ref:30000", "sample": "0.1", "min": "7"}
    assert qd.Reference.of(qd.decode({b"url": b"http://ref:30000", b"sample": b"0.1", b"min": b"7"})) == ref
    with pytest.raises(ConfigError, match="needs a reference"):
        qd.chosen(settings, None, 0.5)
    with pytest.raises(ConfigError, match="http"):
        qd.chosen(settings, "ref:30000", None)
    with pytest.raises(ConfigError, match="fraction"):
        qd.chosen(settings, "http://ref", 1.5)


def test_the_score_of_an_output_is_read_from_sglangs_input_token_logprobs() -> None:
    answer = {"meta_info": {"input_token_logprobs": [[None, 7, None], [-1.0, 5, None], [-2.0, 6, None]]}}
    assert mean_logprob(answer, [5, 6]) == -1.5
    with pytest.raises(Exception, match="not"):
        mean_logprob(answer, [5, 9])


def post(url: str, body: Any) -> Any:
    req = urllib.request.Request(url, orjson.dumps(body), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return orjson.loads(resp.read())


def test_the_sims_generate_scores_input_tokens_as_sglang_does(tmp_path: Path, procs: list[Proc]) -> None:
    proc, url = start_sim(tmp_path)
    procs.append(proc)
    # SGLang's shape: from logprob_start_len on, [logprob, id, null], the first logprob null
    score = {"return_logprob": True, "sampling_params": {"max_new_tokens": 0}}
    one = post(f"{url}/generate", {"input_ids": [4, 5, 6, 7], "logprob_start_len": 1, **score})
    rows = one["meta_info"]["input_token_logprobs"]
    assert [r[1] for r in rows] == [5, 6, 7] and rows[0][0] is None
    assert all(-3 <= r[0] < 0 and r[2] is None for r in rows[1:])
    # a batch answers a list; the same tokens after the same token score the same
    two = post(
        f"{url}/generate", {"input_ids": [[4, 5, 6, 7], [9, 5, 6, 7]], "logprob_start_len": [1, 1], **score}
    )
    assert two[0]["meta_info"]["input_token_logprobs"] == rows
    assert two[1]["meta_info"]["input_token_logprobs"][2:] == rows[2:]
    # and the scorer's teacher forcing reads it
    assert ReferenceServer(url, None).teacher_force([4, 5], [[6, 7]]) == [
        pytest.approx((rows[1][0] + rows[2][0]) / 2)
    ]


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "prompt": f"Write about topic {i}."} for i in range(n)]


def test_a_run_judged_against_itself_shows_no_drift_and_its_drift_rule_can_pause_it(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a run on the sim whose reference is the same sim: none drawn by the fraction, at
    # least 6 scored a partition, and a drift rule that trips on anything once 6 are scored
    proc, url = start_sim(tmp_path)
    procs.append(proc)
    env = worker_env(redis_url, url, quality_sample_min=6)
    for part in ("A", "B"):
        data = write_jsonl(tmp_path / f"{part}.jsonl", rows(15))
        cli("enqueue", str(data), "--run", "q", "--partition", part, "--temperature", "0",
            "--short-max-tokens", "24", "--quality-reference", url, "--quality-sample", "0",
            "--quality-stop", "drift>-1000@6", env=env)  # fmt: skip

    # When a worker runs it
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    wait_run_finished(rclient, "q", 60)

    # Then 6 jobs a partition are scored, each exactly as likely as the reference's own output
    view = wait_for(lambda: (v := qd.drift_view(rclient, "q")) and all(p["n"] == 6 for p in v.values()) and v,
                    30, "6 scored jobs a partition")  # fmt: skip
    assert set(view) == {"A", "B"}
    for figures in view.values():
        assert figures == {"drift": 0.0, "ci95": 0.0, "n": 6, "sampled": 6, "skipped": 0,
                           "reference": url, "error": None}  # fmt: skip
    assert rclient.llen(keys.RunKeys("q").reference_todo()) == 0
    # and the drift rule paused the run, saying why
    reason = rclient.hget(keys.RunKeys("q").paused(), "reason")
    assert reason is not None and b"drift>-1000@6 tripped on partition" in reason, reason


def test_a_reference_that_is_down_is_reported_and_the_run_goes_on(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a run whose reference answers nothing
    proc, url = start_sim(tmp_path)
    procs.append(proc)
    env = worker_env(redis_url, url, quality_sample_min=3)
    down = f"http://127.0.0.1:{free_port()}"
    data = write_jsonl(tmp_path / "d.jsonl", rows(8))
    cli("enqueue", str(data), "--run", "d", "--partition", "P", "--short-max-tokens", "16",
        "--quality-reference", down, "--quality-sample", "0",
        "--quality-stop", "drift>0.5@3", env=env)  # fmt: skip

    # When a worker runs it
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    doc = wait_run_finished(rclient, "d", 60)

    # Then every job is done, the reference's failure is reported, nothing is judged or paused
    assert doc["totals"]["done"] == 8
    view = wait_for(lambda: (v := qd.drift_view(rclient, "d")) and v["P"]["error"] and v, 30, "the error")
    assert "connection" in view["P"]["error"] and view["P"]["n"] == 0 and view["P"]["drift"] is None
    assert view["P"]["sampled"] == 3 and rclient.llen(keys.RunKeys("d").reference_todo()) == 3
    assert not rclient.exists(keys.RunKeys("d").paused())
