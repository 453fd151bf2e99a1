"""``tokenmill flower``: a real Flower on a real worker's events, read through its HTTP API."""

from __future__ import annotations

import base64
import sys
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from producer.web_access import check_exposure, is_loopback, parse_basic_auth
from tests.pipeline import cli, write_jsonl
from tests.procs import Proc, http_status, spawn, start_sim, start_worker, wait_for, worker_env
from tokenmill.errors import ConfigError
from tokenmill.ledger import Ledger
from tokenmill.local_redis import free_port

USER, PASSWORD = "ops", "correct-horse"
TASK_EVENTS_ON = "Events of group {task} enabled by remote"  # Celery's log line
NO_AUTH = {"TOKENMILL_FLOWER_BASIC_AUTH": "", "FLOWER_BASIC_AUTH": ""}


def start_flower(workdir: Path, redis_url: str, *args: str, auth: str | None = None) -> tuple[Proc, str]:
    port = free_port()
    env = {**NO_AUTH, "TOKENMILL_REDIS_URL": redis_url}
    if auth:
        env["TOKENMILL_FLOWER_BASIC_AUTH"] = auth
    proc = spawn(
        [sys.executable, "-m", "tokenmill.cli", "flower", "--port", str(port), *args],
        workdir / f"flower-{port}.log",
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/healthcheck") == 200 or not proc.alive(), 30, "Flower")
    assert proc.alive(), proc.output()
    return proc, url


def get(url: str, auth: tuple[str, str] | None = (USER, PASSWORD)) -> tuple[int, Any]:
    """(status, decoded JSON body or None) of a GET, with basic auth unless ``auth`` is None."""
    headers = {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_flower_shows_the_runs_tasks_with_readable_args_behind_basic_auth(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given Flower (basic auth) on loopback, and a short worker whose events it already receives
    sim, sim_url = start_sim(tmp_path)
    procs.append(sim)
    flower, url = start_flower(tmp_path, redis_url, auth=f"{USER}:{PASSWORD}")
    procs.append(flower)
    env = worker_env(redis_url, sim_url)
    worker = start_worker(tmp_path, "short", env, concurrency=4, name="fl-short")
    procs.append(worker)
    wait_for(
        lambda: any(
            n.startswith("fl-short@") and up for n, up in get(f"{url}/api/workers?status=true")[1].items()
        ),
        20,
        "Flower to see the worker's heartbeat",
    )
    # task events are off by default (settings.task_events): Flower turns them on by itself
    wait_for(lambda: TASK_EVENTS_ON in worker.output(), 20, "Flower to turn the worker's task events on")

    # When five short prompts and two long ones are enqueued (no long worker runs)
    rows = [{"id": f"s{i}", "prompt": f"short question {i}"} for i in range(5)]
    rows += [{"id": f"l{i}", "prompt": "long " * 200} for i in range(2)]
    data = write_jsonl(tmp_path / "F.jsonl", rows)
    flags = ["--short-max-tokens", "32", "--long-max-tokens", "32", "--long-prompt-tokens", "100"]
    cli("enqueue", str(data), "--run", "flw", *flags, env=env)
    wait_for(lambda: Ledger(rclient, "flw").counts()["F"]["done"] == 5, 60, "the short jobs")

    # Then Flower lists each short job's task, succeeded, with the run, partition and job id as args
    def succeeded() -> dict[str, Any] | None:
        _, tasks = get(f"{url}/api/tasks?state=SUCCESS")
        return tasks if len(tasks) == 5 else None

    tasks = wait_for(succeeded, 20, "Flower to list the 5 succeeded tasks")
    assert {t["name"] for t in tasks.values()} == {"tokenmill.generate"}
    assert sorted(t["args"] for t in tasks.values()) == [f"['flw', 'F', 'F:s{i}']" for i in range(5)]
    assert all(t["worker"].startswith("fl-short@") for t in tasks.values())
    # the worker and the queue depths are there too
    status, workers = get(f"{url}/api/workers?refresh=true")
    assert status == 200 and any(n.startswith("fl-short@") for n in workers)
    status, queues = get(f"{url}/api/queues/length")
    depths = {q["name"]: q["messages"] for q in queues["active_queues"]}
    assert status == 200 and depths.get("short") == 0
    assert rclient.llen("long") == 2  # the long jobs wait for a long worker

    # And without (or with wrong) credentials, the API and the UI answer 401
    for path in ("/api/tasks", "/api/workers", "/api/queues/length", "/tasks"):
        assert get(f"{url}{path}", auth=None)[0] == 401, path
        assert get(f"{url}{path}", auth=(USER, "wrong"))[0] == 401, path


def test_flower_refuses_to_bind_beyond_loopback_without_auth(redis_url: str) -> None:
    res = cli(
        "flower", "--address", "0.0.0.0", "--port", str(free_port()), env={**NO_AUTH}, check=False, timeout=30
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "refusing to bind Flower to 0.0.0.0 without authentication" in res.stderr
    assert "TOKENMILL_FLOWER_BASIC_AUTH" in res.stderr


def test_exposure_rules() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("flower.example.com")
    check_exposure("127.0.0.1", [], "Flower", "")
    check_exposure("0.0.0.0", ["ops:pw"], "Flower", "")
    with pytest.raises(ConfigError, match="every interface"):
        check_exposure("", [], "Flower", "")


def test_basic_auth_must_be_user_colon_password_and_errors_never_show_the_password() -> None:
    assert parse_basic_auth("a:b,c:d:e", "") == ["a:b", "c:d:e"]
    assert parse_basic_auth(None, "") == [] and parse_basic_auth("", "") == []
    for bad in ("hunter2", "ops:", ":hunter2", "ops:pw,hunter2"):
        with pytest.raises(ConfigError) as err:
            parse_basic_auth(bad, "")
        assert "hunter2" not in str(err.value)
