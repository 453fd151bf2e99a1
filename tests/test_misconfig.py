"""Misconfiguration loses nothing: a wrong API key, a URL that is not SGLang, Redis durability."""

from __future__ import annotations

import sys
from pathlib import Path

import redis

from producer.status import run_status
from tests.keyspace import key_events
from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import Proc, RedisServer, free_port, spawn, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys


def _hold_while_alone(client: redis.Redis, run: str, passes: int) -> list[dict[str, int]]:
    """Look at the run until the (only) worker's pump has taken its lock ``passes`` times; each
    look: the failed and done totals, the retries spent and the claims made (attempts)."""
    samples = []
    seen = 0
    pattern = keys.RunKeys(run).job("*")
    with key_events(client, keys.pump_lock()) as events:

        def look() -> bool:
            nonlocal seen
            seen += sum(event == "set" for _, event in events.read())
            totals = run_status(client, run)["totals"]
            jobs = [client.hmget(k, "retries", "attempts") for k in client.scan_iter(pattern)]
            sample = {"failed": totals["failed"], "done": totals["done"]}
            sample["retries"], sample["attempts"] = (sum(int(j[i] or 0) for j in jobs) for i in (0, 1))
            samples.append(sample)
            return seen >= passes

        wait_for(look, 30, f"{passes} passes of the worker's pump")
    return samples


def test_wrong_api_key_stops_the_worker_claiming_without_failing_jobs(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a sim that requires an API key and a worker configured with the wrong one
    sim, url = start_sim(tmp_path, "--api-key", "right-key")
    procs.append(sim)
    data = write_jsonl(tmp_path / "P.jsonl", [{"prompt": f"q{i}"} for i in range(6)])
    cli("enqueue", str(data), "--run", "r", env={"TOKENMILL_REDIS_URL": redis_url})
    # (with two attempts per job, a worker that spent retries on the 401 would soon fail jobs)
    bad_env = worker_env(redis_url, url, api_key="wrong-key", max_attempts=2)
    bad = start_worker(tmp_path, "short", bad_env, concurrency=2)
    procs.append(bad)

    # When it meets the 401, it says so once and stops consuming; no job fails
    wait_for(lambda: "refused the API key" in bad.output(), 30, "the worker to report the refused key")
    wait_for(
        lambda: (
            "cancel_consumer" in bad.output()
            or "Canceling queue" in bad.output()
            or "canceling" in bad.output().lower()
        ),
        20,
        "the worker to stop consuming",
    )
    doc = run_status(rclient, "r")
    assert doc["totals"]["failed"] == 0 and doc["totals"]["done"] == 0
    # and as long as it runs alone (three passes of its pump, which promotes delayed retries),
    # at every look: no job failed or done, no retry spent, no claim beyond its two threads' first
    samples = _hold_while_alone(rclient, "r", passes=3)
    assert all(s["failed"] == s["done"] == s["retries"] == 0 and s["attempts"] <= 2 for s in samples), samples
    assert bad.output().count("refused the API key") == 1
    assert "wrong-key" not in bad.output()

    # Then a worker with the right key finishes the run
    procs.append(
        start_worker(tmp_path, "short", worker_env(redis_url, url, api_key="right-key"), concurrency=2)
    )
    assert wait_run_finished(rclient, "r", 60)["totals"]["done"] == 6


def test_a_server_url_that_is_not_sglang_makes_jobs_wait_not_fail(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    port = free_port()
    (tmp_path / "www").mkdir()
    web = spawn(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(tmp_path / "www")],
        tmp_path / "web.log",
    )
    procs.append(web)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: "Serving HTTP" in web.output(), 20, "the plain web server")
    data = write_jsonl(tmp_path / "P.jsonl", [{"prompt": f"q{i}"} for i in range(3)])
    cli("enqueue", str(data), "--run", "r", env={"TOKENMILL_REDIS_URL": redis_url})
    w = start_worker(tmp_path, "short", worker_env(redis_url, url), concurrency=2)
    procs.append(w)
    wait_for(lambda: "is this an SGLang server?" in w.output(), 30, "the worker to name the bad server")
    assert url in w.output()
    doc = run_status(rclient, "r")
    assert doc["totals"]["failed"] == 0 and doc["totals"]["done"] == 0
    assert all(int(rclient.hget(k, "retries") or 0) == 0 for k in rclient.scan_iter("tm:r:job:*"))


def test_enqueue_warns_when_redis_would_lose_or_evict_work(tmp_path: Path) -> None:
    rds = RedisServer(tmp_path / "r").start()
    try:
        client = rds.client()
        client.config_set("appendonly", "no")
        client.config_set("maxmemory-policy", "allkeys-lru")
        data = write_jsonl(tmp_path / "P.jsonl", [{"prompt": "x"}])
        res = cli("enqueue", str(data), "--run", "r", env={"TOKENMILL_REDIS_URL": rds.url})
        assert "appendonly=no" in res.stderr and "CONFIG SET appendonly yes" in res.stderr
        assert "maxmemory-policy=allkeys-lru" in res.stderr and "noeviction" in res.stderr
        client.config_set("appendonly", "yes")
        client.config_set("maxmemory-policy", "noeviction")
        quiet = cli("enqueue", str(data), "--run", "r", env={"TOKENMILL_REDIS_URL": rds.url})
        assert "WARNING" not in quiet.stderr
    finally:
        rds.kill()
