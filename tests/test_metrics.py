"""``tokenmill metrics``: a real exporter process scraped over HTTP, reading the test Redis."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import Proc, http_status, spawn, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys, servers
from tokenmill.local_redis import free_port

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def start_metrics(workdir: Path, redis_url: str) -> tuple[Proc, str]:
    port = free_port()
    proc = spawn(
        [sys.executable, "-m", "tokenmill.cli", "metrics", "--port", str(port)],
        workdir / f"metrics-{port}.log",
        env={"TOKENMILL_REDIS_URL": redis_url},
    )
    url = f"http://127.0.0.1:{port}/metrics"
    wait_for(lambda: http_status(url) == 200 or not proc.alive(), 30, "the metrics endpoint")
    assert proc.alive(), proc.output()
    return proc, url


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def prompts(tmp_path: Path, partition: str, n: int) -> Path:
    return write_jsonl(tmp_path / f"{partition}.jsonl", [{"prompt": f"{partition} q{i}"} for i in range(n)])


def test_queued_jobs_failures_admission_and_servers_are_read_from_redis_at_scrape_time(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a run with two partitions enqueued (no worker), a failure class on record, a published
    # server and its admission slots
    env = {"TOKENMILL_REDIS_URL": redis_url}
    cli("enqueue", str(prompts(tmp_path, "A", 3)), str(prompts(tmp_path, "B", 2)), "--run", "m1", env=env)
    rclient.hincrby(keys.RunKeys("m1").failures(), "context_length", 2)
    servers.publish(
        rclient,
        servers.ServerRecord(
            name="gpu0",
            url="http://127.0.0.1:30000",
            state=servers.READY,
            engine="sim",
            max_total_num_tokens=159_000,
            context_length=32_768,
            restarts=1,
            live={"running_req": 3, "token_usage": 0.25},
        ),
    )
    rclient.zadd(keys.admission("gpu0"), {"slot-a": 2**50, "slot-b": 2**50})
    rclient.hset(
        keys.admission_used("gpu0"),
        mapping={"total": 5000, "budget": 143_000, "short": 5000, "cap:short": 107_250},
    )
    proc, url = start_metrics(tmp_path, redis_url)
    procs.append(proc)

    # When Prometheus scrapes
    samples = scrape(url)

    # Then it sees the ledger as it is now
    assert value(samples, "tokenmill_redis_up") == 1
    assert value(samples, "tokenmill_jobs", run="m1", partition="A", state="queued") == 3
    assert value(samples, "tokenmill_jobs", run="m1", partition="B", state="queued") == 2
    assert value(samples, "tokenmill_jobs", run="m1", partition="A", state="done") == 0
    assert value(samples, "tokenmill_queue_messages", queue="short") == 5
    assert value(samples, "tokenmill_completion_tokens_total", run="m1") == 0
    assert value(samples, "tokenmill_job_failures_total", run="m1", **{"class": "context_length"}) == 2
    assert value(samples, "tokenmill_server_state", server="gpu0", state="ready") == 1
    assert value(samples, "tokenmill_server_state", server="gpu0", state="down") == 0
    assert value(samples, "tokenmill_server_max_total_num_tokens", server="gpu0") == 159_000
    assert value(samples, "tokenmill_server_context_length_tokens", server="gpu0") == 32_768
    assert value(samples, "tokenmill_server_restarts_total", server="gpu0") == 1
    assert value(samples, "tokenmill_server_live", server="gpu0", figure="running_req") == 3
    assert value(samples, "tokenmill_admission_slots", server="gpu0") == 2
    assert value(samples, "tokenmill_admission_used_tokens", server="gpu0") == 5000
    assert value(samples, "tokenmill_admission_budget_tokens", server="gpu0") == 143_000
    assert value(samples, "tokenmill_admission_queue_tokens", server="gpu0", queue="short") == 5000
    assert value(samples, "tokenmill_admission_queue_cap_tokens", server="gpu0", queue="short") == 107_250
    assert value(samples, "tokenmill_admission_queue_tokens", server="gpu0", queue="long") is None
    assert all(name.startswith("tokenmill_") for name, _ in samples)

    # And the next scrape follows a change without restarting anything
    servers.update(rclient, "gpu0", state=servers.DOWN)
    rclient.delete(keys.admission("gpu0"), keys.admission_used("gpu0"))
    samples = scrape(url)
    assert value(samples, "tokenmill_server_state", server="gpu0", state="down") == 1
    assert value(samples, "tokenmill_admission_slots", server="gpu0") == 0
    assert value(samples, "tokenmill_admission_used_tokens", server="gpu0") is None


def test_a_finished_run_shows_done_jobs_and_generated_tokens(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a sim, a short worker and six prompts
    sim, sim_url = start_sim(tmp_path)
    procs.append(sim)
    env = worker_env(redis_url, sim_url)
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    proc, url = start_metrics(tmp_path, redis_url)
    procs.append(proc)
    cli("enqueue", str(prompts(tmp_path, "P", 6)), "--run", "m2", "--short-max-tokens", "64", env=env)

    # When the run finishes
    wait_run_finished(rclient, "m2", 60)
    samples = scrape(url)

    # Then every job is counted done and the tokens the sim generated are reported
    assert value(samples, "tokenmill_jobs", run="m2", partition="P", state="done") == 6
    assert total(samples, "tokenmill_jobs", run="m2") == 6
    tokens = value(samples, "tokenmill_completion_tokens_total", run="m2")
    assert tokens is not None and tokens > 0
    assert tokens == int(rclient.hget(keys.RunKeys("m2").stats(), "completion_tokens") or 0)
    assert value(samples, "tokenmill_queue_messages", queue="short") == 0


def test_an_unreachable_redis_is_reported_not_fatal(tmp_path: Path, procs: list[Proc]) -> None:
    # Given an exporter whose Redis is not running
    proc, url = start_metrics(tmp_path, f"redis://127.0.0.1:{free_port()}/0")
    procs.append(proc)

    # Then scrapes still answer, with tokenmill_redis_up 0, and the exporter keeps serving
    samples = scrape(url)
    assert value(samples, "tokenmill_redis_up") == 0
    assert proc.alive()
    proc.stop()
    assert proc.proc.returncode == 0, proc.output()
