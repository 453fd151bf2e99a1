"""Drift against a reference server (tokenmill/quality_drift.py, workers/reference.py): the
figures, the sim's ``/generate``, and a run judged on the sim by a real worker."""

from __future__ import annotations

import math
import random
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from producer.metrics import registry_for
from producer.status import run_status
from tests.faultproxy import FaultProxy
from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import Proc, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys
from tokenmill import quality_drift as qd
from tokenmill.errors import ConfigError
from tokenmill.ledger import Ledger
from tokenmill.local_redis import free_port
from tokenmill.settings import Settings
from workers.reference import BACKOFF_S, ReferenceServer, mean_logprob


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


def test_the_python_apis_enqueue_stores_the_settings_reference_as_the_cli_does(redis_url: str) -> None:
    # Given a client whose settings name a reference (TOKENMILL_QUALITY_REFERENCE_URL)
    from tokenmill import Client

    ref = "http://127.0.0.1:9"
    with Client(redis_url=redis_url, quality_reference_url=ref + "/", quality_sample=0.25) as client:
        # When it enqueues a run
        client.enqueue([{"prompt": "hi"}], run="api-ref")
        # Then the run is judged against that reference, as `tokenmill enqueue` would judge it
        raw = qd.decode(redis.Redis.from_url(redis_url).hgetall(keys.RunKeys("api-ref").quality_reference()))
        assert qd.Reference.of(raw) == qd.Reference(ref, 0.25, Settings.load({}).quality_sample_min)


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


REFERENCE_DEADLINE_S = 8.0  # the test's quality_reference_timeout_s
JOB_GAP_S = REFERENCE_DEADLINE_S * 0.75  # the run's commits come closer than this throughout


def reference_up(client: redis.Redis, run: str) -> float:
    """``tokenmill_quality_reference_up`` of ``run``'s partition P, as the exporter serves it."""
    families = text_string_to_metric_families(generate_latest(registry_for(client)).decode())
    labels = {"run": run, "partition": "P"}
    return next(s.value for f in families for s in f.samples
                if s.name == "tokenmill_quality_reference_up" and s.labels == labels)  # fmt: skip


def test_a_reference_whose_host_vanishes_is_reported_by_its_deadline_and_the_run_never_waits(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a run of 48 jobs (16 tokens at 20 ms: ~0.3 s each) on one worker slot (a wait on the
    # reference anywhere on a job's path would show as a gap between commits), whose reference
    # is a slower sim (~0.7 s a scoring) behind a loopback proxy, a quarter of its jobs sampled
    # (and the first 8), and leases no load spike outlives (no job is taken over)
    sim, url = start_sim(tmp_path, "--sim-step-ms", "20")
    ref, ref_url = start_sim(tmp_path, "--sim-step-ms", "40")
    procs += [sim, ref]
    env = worker_env(redis_url, url, lease_ttl_s=30, quality_sample_min=8,
                     quality_reference_timeout_s=REFERENCE_DEADLINE_S)  # fmt: skip
    k, total = keys.RunKeys("v"), 48
    with FaultProxy(int(ref_url.rsplit(":", 1)[1])) as proxy:
        data = write_jsonl(tmp_path / "v.jsonl", rows(total))
        cli("enqueue", str(data), "--run", "v", "--partition", "P", "--short-max-tokens", "16",
            "--quality-reference", f"http://{proxy.address()}", "--quality-sample", "0.25",
            env=env)  # fmt: skip
        procs.append(start_worker(tmp_path, "short", env, concurrency=1))
        wait_for(lambda: qd.drift_view(rclient, "v")["P"]["n"] >= 1 and rclient.llen(k.reference_todo()) >= 2,
                 30, "a job scored through the proxy and 2 waiting")  # fmt: skip
        assert reference_up(rclient, "v") == 1

        # When the reference's host vanishes mid-run (its connections held open, never answered),
        # with sampled jobs waiting: one is being scored, or will be at once
        proxy.vanish()
        gone_ms, sampled = time.time() * 1000, qd.drift_view(rclient, "v")["P"]["sampled"]
        assert run_status(rclient, "v")["totals"]["done"] <= total - 16, "the run ended before the fault"

        # Then the scoring in flight gives up by its deadline (a timeout: its connection was
        # accepted, never refused), and status and the metric say the reference is down
        def down() -> str | None:
            error: str | None = run_status(rclient, "v")["partitions"]["P"]["quality"]["reference_error"]
            return error

        assert "timed out" in wait_for(down, REFERENCE_DEADLINE_S + 5, "the reference reported down")
        failed_ms = int(rclient.hget(k.quality_reference(), qd.ERROR_MS) or 0)
        assert failed_ms - gone_ms < (REFERENCE_DEADLINE_S + 3) * 1000 and reference_up(rclient, "v") == 0
        # and the run goes on to its end unjudged: every job done once, sampled ones among those
        # done in the outage, and never a gap between commits near the reference's deadline
        doc = wait_run_finished(rclient, "v", 120)
        assert doc["totals"]["done"] == total and doc["totals"]["failed"] == 0 and not doc.get("paused")
        jobs = [Ledger(rclient, "v").job(f"P:r{i}") for i in range(total)]
        assert [int(j["attempts"]) for j in jobs] == [1] * total
        done_ms = sorted(int(j["done_ms"]) for j in jobs)
        since = [min(int(j["claimed_ms"]) for j in jobs), *done_ms[:-1]]
        gaps = [b - a for a, b in zip(since, done_ms, strict=True)]
        assert max(gaps) < JOB_GAP_S * 1000, gaps
        assert qd.drift_view(rclient, "v")["P"]["sampled"] > sampled

        # When the reference's host comes back at the same address
        proxy.replace()
        # Then scoring resumes after the scorer's backoff: every waiting job is scored, the error
        # is cleared, and the metric says the reference is up
        view = wait_for(lambda: (v := qd.drift_view(rclient, "v")["P"])["error"] is None
                        and v["n"] + v["skipped"] == v["sampled"] and v,
                        REFERENCE_DEADLINE_S + BACKOFF_S + 60, "the waiting jobs scored")  # fmt: skip
    assert view["n"] == view["sampled"] and rclient.llen(k.reference_todo()) == 0
    assert reference_up(rclient, "v") == 1
