"""Day-two operations end to end: real redis-server, real celery workers, the sim over HTTP.

retry after the cause of failures is removed, cancel (and cancel --now) that leaves nothing
running, samples per prompt with distinct seeds, and the list of runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from producer.metrics import registry_for
from producer.status import run_status
from server_mgr.sim.textgen import expected_completion
from tests.pipeline import cli, expected_for, read_export, wait_run_finished, write_jsonl
from tests.procs import Proc, sim_stats, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys
from tokenmill.jobspec import sample_seed


def _sim_and_env(
    tmp_path: Path, redis_url: str, procs: list[Proc], *sim_args: str
) -> tuple[Proc, str, dict[str, str]]:
    """A sim (stopped with the test), its URL, and the workers' and CLI's environment."""
    sim, url = start_sim(tmp_path, *sim_args)
    procs.append(sim)
    return sim, url, worker_env(redis_url, url)


def _totals(client: redis.Redis, run: str) -> dict[str, int]:
    return run_status(client, run)["totals"]


def _assert_texts(rows: list[dict[str, Any]], max_tokens: int, mean_output_tokens: int) -> None:
    """Each exported row's answer is the sim's uninterrupted output for its prompt, byte for byte:
    a retried, cancelled or continued job's text is the one a single clean run would have."""
    assert rows
    for row in rows:
        want = expected_for(
            row, max_tokens=max_tokens, reasoning=False, mean_output_tokens=mean_output_tokens
        )
        got = row["messages"][-1]
        assert (got["role"], got["content"]) == ("assistant", want.content), row["id"]


def test_failed_jobs_are_retried_to_completion_once_the_cause_is_removed(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a server whose context is too short for 3 of 13 prompts: they fail context_length
    sim, url, env = _sim_and_env(tmp_path, redis_url, procs, "--context-length", "600")
    rows = [{"id": f"s{i}", "prompt": f"short question {i}"} for i in range(10)]
    rows += [{"id": f"l{i}", "prompt": f"long question {i} " + "w " * 1500} for i in range(3)]
    data = write_jsonl(tmp_path / "P.jsonl", rows)
    cli("enqueue", str(data), "--run", "r", "--short-max-tokens", "40", "--long-max-tokens", "40", env=env)
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    procs.append(start_worker(tmp_path, "long", env, concurrency=2))
    doc = wait_run_finished(rclient, "r", 60)
    assert doc["totals"]["failed"] == 3 and doc["failures"] == {"context_length": 3}

    # Bad input names itself: an unknown class, an unknown run, a partition that does not exist
    bad = cli("retry", "--run", "r", "--class", "context_lenght", env=env, check=False)
    assert bad.returncode == 2 and "--class 'context_lenght' is not a failure class" in bad.stderr
    assert "this run's failed jobs have: context_length (3)" in bad.stderr
    bad = cli("retry", "--run", "nope", env=env, check=False)
    assert bad.returncode == 2 and "--run 'nope': no run of that name in this Redis" in bad.stderr
    bad = cli("retry", "--run", "r", "--partition", "Q", env=env, check=False)
    assert bad.returncode == 2 and "--partition 'Q': run 'r' has no partition of that name" in bad.stderr
    # and a class with no failed jobs retries nothing
    assert "no failed jobs to retry" in cli("retry", "--run", "r", "--class", "stall", env=env).stdout

    # When the server comes back with a longer context and the context_length failures are retried
    port = int(url.rsplit(":", 1)[1])
    sim.stop()
    sim2, _ = start_sim(tmp_path, "--context-length", "32768", port=port)
    procs.append(sim2)
    out = cli("retry", "--run", "r", "--class", "context_length", "--partition", "P", "--json", env=env)

    # Then all three are back, and the run finishes with every job done and nothing failed
    assert orjson.loads(out.stdout) == {
        "run": "r",
        "partition": "P",
        "from": "failed",
        "retried": 3,
        "by_class": {"context_length": 3},
        "backlogged": 0,
    }
    doc = wait_run_finished(rclient, "r", 60)
    assert doc["totals"] == {"queued": 0, "running": 0, "done": 13, "failed": 0, "total": 13}
    assert doc["failures"] == {}
    job = {k.decode(): v.decode() for k, v in rclient.hgetall(keys.RunKeys("r").job("P:l0")).items()}
    assert job["last_error_class"] == "context_length" and job["attempts"] == "2"
    # the failures metric still counts every job that ever failed (a counter never goes down)
    text = generate_latest(registry_for(rclient)).decode()
    failures = {
        s.labels["class"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "tokenmill_job_failures_total"
    }
    assert failures == {"context_length": 3.0}
    cli("export", "--run", "r", "--out", str(tmp_path / "out"), "--include-truncated", env=env)
    exported = read_export(tmp_path / "out")["P"]
    assert sorted(row["id"] for row in exported) == sorted(row["id"] for row in rows)
    _assert_texts(exported, max_tokens=40, mean_output_tokens=40)


def test_cancel_now_stops_running_streams_keeps_checkpoints_and_leaves_nothing_running(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given 24 slow generations (about 50 tokens/s each, 6 s at most), 6 of them running
    _sim, url, env = _sim_and_env(
        tmp_path, redis_url, procs, "--sim-step-ms", "20", "--sim-mean-output-tokens", "2000"
    )
    data = write_jsonl(tmp_path / "C.jsonl", [{"id": str(i), "prompt": f"tell story {i}"} for i in range(24)])
    cli("enqueue", str(data), "--run", "c", "--short-max-tokens", "300", env=env)
    procs.append(start_worker(tmp_path, "short", env, concurrency=6))
    k = keys.RunKeys("c")

    def streaming() -> list[str]:
        ids = [x.decode() for x in rclient.zrange(k.leases(), 0, -1)]
        return (
            ids if len(ids) == 6 and all(int(rclient.hget(k.job(j), "ckpt_tokens") or 0) for j in ids) else []
        )

    running = wait_for(streaming, 30, "six jobs streaming with a checkpoint")

    # When the run is cancelled with --now
    started = time.monotonic()
    out = cli("cancel", "--run", "c", "--now", env=env).stdout
    assert "cancelled 18 queued jobs; 6 running jobs stop within a few seconds" in out, out
    wait_for(lambda: _totals(rclient, "c")["running"] == 0, 10, "the running jobs to stop")
    stopped_s = time.monotonic() - started

    # Then the streams stopped within a few seconds, every job is cancelled, checkpoints kept
    assert stopped_s < 5, f"cancel --now took {stopped_s:.1f}s"
    assert _totals(rclient, "c") == {
        "queued": 0,
        "running": 0,
        "done": 0,
        "failed": 0,
        "cancelled": 24,
        "total": 24,
    }
    kept = {j: int(rclient.hget(k.job(j), "ckpt_tokens") or 0) for j in running}
    assert all(n > 0 for n in kept.values()), kept
    # nothing runs on the server, and the messages still in the broker are no-ops
    wait_for(lambda: sim_stats(url)["running"] == 0, 10, "the sim to have no running request")
    requests = sim_stats(url)["chat_requests"]
    wait_for(lambda: rclient.llen("short") == 0, 30, "the worker to drain the cancelled jobs' messages")
    assert sim_stats(url)["chat_requests"] == requests
    assert _totals(rclient, "c")["cancelled"] == 24

    # status, runs and the metrics show the cancelled state
    status = orjson.loads(cli("status", "--run", "c", "--json", env=env).stdout)
    assert status["partitions"]["C"]["cancelled"] == 24
    human = cli("status", "--run", "c", env={**env, "COLUMNS": "160"}).stdout
    assert "24 cancelled" in human and "cancelled" in human.splitlines()[1]
    runs = orjson.loads(cli("runs", "--json", env=env).stdout)["runs"]
    assert runs[0]["run"] == "c" and runs[0]["totals"]["cancelled"] == 24
    assert (
        'tokenmill_jobs{partition="C",run="c",state="cancelled"} 24.0'
        in generate_latest(registry_for(rclient)).decode()
    )

    # When the cancelled jobs are retried, the run finishes; the stopped ones continued
    out = cli("retry", "--run", "c", "--cancelled", env=env).stdout
    assert "24 cancelled jobs back to queued" in out, out
    procs.append(start_worker(tmp_path, "short", env, concurrency=18))
    doc = wait_run_finished(rclient, "c", 60)
    assert doc["totals"]["done"] == 24 and doc["totals"]["cancelled"] == 0
    for j in running:
        result = orjson.loads(rclient.hget(k.job(j), "result"))
        assert result["continued_tokens"] >= kept[j], (j, result)
    # and every answer, the continued ones too, is the text one uninterrupted run gives
    cli("export", "--run", "c", "--out", str(tmp_path / "out"), "--include-truncated", env=env)
    exported = read_export(tmp_path / "out")["C"]
    assert sorted(row["id"] for row in exported) == sorted(str(i) for i in range(24))
    _assert_texts(exported, max_tokens=300, mean_output_tokens=2000)


def test_cancel_lets_running_jobs_finish_and_a_partition_alone_can_be_cancelled(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    _sim, _url, env = _sim_and_env(
        tmp_path, redis_url, procs, "--sim-step-ms", "20", "--sim-mean-output-tokens", "60"
    )
    a = write_jsonl(tmp_path / "A.jsonl", [{"prompt": f"a{i}"} for i in range(20)])
    b = write_jsonl(tmp_path / "B.jsonl", [{"prompt": f"b{i}"} for i in range(5)])
    cli("enqueue", str(a), str(b), "--run", "p", "--short-max-tokens", "100", env=env)
    procs.append(start_worker(tmp_path, "short", env, concurrency=2))
    wait_for(lambda: _totals(rclient, "p")["running"] == 2, 30, "two running jobs")

    out = cli("cancel", "--run", "p", "--partition", "A", "--json", env=env).stdout

    summary = orjson.loads(out)
    assert summary["partition"] == "A" and summary["now"] is False
    doc = wait_for(
        lambda: (d := run_status(rclient, "p"))["totals"]["running"] + d["totals"]["queued"] == 0 and d,
        60,
        "partition B to finish",
    )
    # the jobs that were running finished (done), the rest of A is cancelled, B ran to the end
    parts = doc["partitions"]
    assert summary["running"] == 2 and parts["A"]["cancelled"] == summary["cancelled"]
    assert parts["A"]["done"] + parts["A"]["cancelled"] == 20
    assert parts["B"] == {"queued": 0, "running": 0, "done": 5, "failed": 0, "cancelled": 0,
                          "quality": parts["B"]["quality"]}  # fmt: skip
    assert parts["B"]["quality"]["judged"] == 5
    bad = cli("cancel", "--run", "p", "--partition", "Z", env=env, check=False)
    assert bad.returncode == 2 and "--partition 'Z': run 'p' has no partition of that name" in bad.stderr
    assert "(its partitions: A, B)" in bad.stderr
    exported = cli(
        "export", "--run", "p", "--out", str(tmp_path / "o"), "--include-truncated", env=env
    ).stdout
    assert f"{summary['cancelled']} cancelled (not exported)" in exported
    # the jobs that ran, in A and in B, are exported each with its own text
    rows = read_export(tmp_path / "o")
    assert (len(rows["A"]), len(rows["B"])) == (parts["A"]["done"], 5)
    _assert_texts(rows["A"] + rows["B"], max_tokens=100, mean_output_tokens=60)


def test_samples_per_prompt_have_their_own_seeds_and_grow_without_repeats(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given 4 prompts (two with ids, two without, one of those twice), 3 samples each
    _sim, _url, env = _sim_and_env(tmp_path, redis_url, procs, "--sim-mean-output-tokens", "20")
    rows = [{"id": "x", "prompt": "p x"}, {"id": "y", "prompt": "p y"}, {"prompt": "p z"}, {"prompt": "p w"}]
    data = write_jsonl(tmp_path / "S.jsonl", [*rows, {"prompt": "p z"}])
    flags = ["--run", "s", "--seed", "7", "--temperature", "0.8", "--short-max-tokens", "64"]
    first = cli("enqueue", str(data), *flags, "--samples", "3", env=env).stdout
    assert "12 new" in first and "3 already queued" in first, first

    # When the same file is enqueued again with 5 samples, only the 2 new samples per prompt are added
    again = cli("enqueue", str(data), *flags, "--samples", "5", env=env).stdout
    assert "8 new" in again and "17 already queued" in again, again
    procs.append(start_worker(tmp_path, "short", env, concurrency=8))
    wait_run_finished(rclient, "s", 60)
    cli("export", "--run", "s", "--out", str(tmp_path / "out"), env=env)

    # Then each prompt is exported 5 times, samples 0..4, each text the sim's for its own seed
    exported = read_export(tmp_path / "out")["S"]
    assert len(exported) == 20
    by_prompt: dict[str, list[int]] = {}
    for row in exported:
        by_prompt.setdefault(row["id"], []).append(row["sample"])
        want = expected_completion(
            row["messages"][:-1],
            seed=sample_seed(7, row["sample"]),
            temperature=0.8,
            max_tokens=64,
            mean_output_tokens=20,
        )
        assert row["messages"][-1]["content"] == want.content
    assert {i: sorted(s) for i, s in by_prompt.items()} == {i: list(range(5)) for i in by_prompt}
    assert {"x", "y"} <= set(by_prompt) and len(by_prompt) == 4
    texts = {r["messages"][-1]["content"] for r in exported if r["id"] == "x"}
    assert len(texts) == 5, "distinct seeds give distinct samples"
    spec = orjson.loads(rclient.hget(keys.RunKeys("s").job("S:x#4"), "spec"))
    assert spec["request"]["seed"] == sample_seed(7, 4) and spec["sample"] == 4

    # And `runs` lists this run before an older one, with its tokens and times
    old = write_jsonl(tmp_path / "O.jsonl", [{"prompt": "old"}])
    rclient.hset(keys.RunKeys("old").stats(), "first_enqueue_ms", 1_000)  # an older run
    cli("enqueue", str(old), "--run", "old", env=env)
    listed = orjson.loads(cli("runs", "--json", env=env).stdout)["runs"]
    assert [r["run"] for r in listed] == ["s", "old"]
    s = listed[0]
    assert s["totals"]["done"] == 20 and s["completion_tokens"] > 0
    assert s["partitions"] == {"S": {"queued": 0, "running": 0, "done": 20, "failed": 0}}
    assert s["first_enqueue_at"] <= s["last_activity_at"] <= time.time() + 5
    human = cli("runs", env={**env, "COLUMNS": "200"}).stdout.splitlines()
    assert "first enqueue" in human[0] and [line.split()[0] for line in human[1:]] == ["s", "old"]
