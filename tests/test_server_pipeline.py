"""A running pipeline rides through a server crash supervised by `tokenmill server up`."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import redis

from server_mgr.consumers import celery_control
from tests.pipeline import cli, expected_for, read_export, wait_run_finished, write_jsonl
from tests.procs import Proc, start_worker, wait_for, worker_env
from tests.server_fixtures import Up, sim_server, write_config
from tokenmill.settings import Settings

MEAN = 80


def _queues(control: object) -> dict[str, list[str]] | None:
    replies = control.inspect(timeout=1.0).active_queues()  # type: ignore[attr-defined]
    if not replies:
        return None
    return {worker: [q["name"] for q in queues] for worker, queues in replies.items()}


def _cancels(worker: Proc) -> int:
    """How often the worker's Celery consumer has cancelled queue short (a pause), by its log."""
    return worker.output().count("Canceling queue short")


def test_jobs_ride_through_an_engine_crash_without_failing_or_burning_retries(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a supervised sim, a worker on it, and a run in progress
    table = sim_server(tmp_path, sim={"mean_output_tokens": MEAN, "step_ms": 15})
    config = write_config(tmp_path / "servers.toml", table)
    url = f"http://127.0.0.1:{table['port']}"
    with Up(config, redis_url) as up:
        first = up.wait_state("ready", timeout_s=30)
        assert first.max_total_num_tokens and first.context_length
        env = worker_env(redis_url, url)
        rows = [{"id": str(i), "prompt": f"tell me about item {i}"} for i in range(60)]
        cli(
            "enqueue",
            str(write_jsonl(tmp_path / "P.jsonl", rows)),
            "--run",
            "r",
            "--short-max-tokens",
            "300",
            env=env,
        )
        worker = start_worker(tmp_path, "short", env, concurrency=16)
        procs.append(worker)
        control = celery_control(Settings.load(env={}, redis_url=redis_url))
        wait_for(
            lambda: (_queues(control) or {}).get(next(iter(_queues(control) or {"": []}))) == ["short"],
            20,
            "the worker to consume short",
        )
        wait_for(
            lambda: any(
                int(rclient.hget(k, "ckpt_tokens") or 0) > 0 for k in rclient.scan_iter("tm:r:job:*")
            ),
            30,
            "streams in progress",
        )

        # When the engine is SIGKILLed mid-stream
        cancels = _cancels(worker)
        os.kill(first.pid, signal.SIGKILL)

        # Then the manager pauses the consumers while it is down (Celery's own log line: the
        # pause may last less than an inspect round trip, since the sim restarts in about a
        # second, so inspect could miss it)...
        wait_for(lambda: rclient.hget("tm:_:control", "paused"), 20, "the manager to pause consumers")
        wait_for(lambda: _cancels(worker) > cancels, 20, "the worker to cancel its consumer of short")
        # ...restarts the engine, and resumes them
        again = up.wait_state("ready", timeout_s=30, where=lambda r: r.restarts == 1)
        assert again.pid != first.pid
        wait_for(
            lambda: all(qs == ["short"] for qs in (_queues(control) or {"x": []}).values()),
            20,
            "celery inspect to show short consumed again",
        )
        doc = wait_run_finished(rclient, "r", 120)

    # and every job finished exactly once, none failed, no retry burned, texts exact
    assert doc["totals"]["done"] == 60 and doc["totals"]["failed"] == 0
    assert all(int(rclient.hget(k, "retries") or 0) == 0 for k in rclient.scan_iter("tm:r:job:*"))
    out = tmp_path / "out"
    cli("export", "--run", "r", "--out", str(out), "--include-truncated", env=env)
    exported = read_export(out)["P"]
    assert sorted(int(r["id"]) for r in exported) == list(range(60))
    for row in exported:
        assert (
            row["messages"][-1]["content"]
            == expected_for(row, max_tokens=300, reasoning=False, mean_output_tokens=MEAN).content
        )
