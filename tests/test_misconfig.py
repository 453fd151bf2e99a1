"""Misconfiguration loses nothing: a URL that is not SGLang, Redis durability (a wrong API key:
``tests/test_sglang_pipeline.py``, on both engines)."""

from __future__ import annotations

import sys
from pathlib import Path

import redis

from producer.status import run_status
from tests.pipeline import cli, write_jsonl
from tests.procs import Proc, RedisServer, free_port, spawn, start_worker, wait_for, worker_env


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


def test_enqueue_warns_when_redis_would_lose_or_evict_work_or_double_its_memory(tmp_path: Path) -> None:
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
        client.config_set("hash-max-listpack-value", "64")  # Redis's own default
        roomy = cli("enqueue", str(data), "--run", "r", env={"TOKENMILL_REDIS_URL": rds.url})
        assert "hash-max-listpack-value=64" in roomy.stderr and "appendonly" not in roomy.stderr
        assert "CONFIG SET hash-max-listpack-value 8192" in roomy.stderr
        client.config_set("hash-max-listpack-value", "8192")
        quiet = cli("enqueue", str(data), "--run", "r", env={"TOKENMILL_REDIS_URL": rds.url})
        assert "WARNING" not in quiet.stderr
    finally:
        rds.kill()
