"""`tokenmill server up` supervising real sim processes: readiness, restarts, verdicts, stop.

Every test runs the real command in its own process, kills or wedges the real server, and reads
the outcome from Redis, as workers and `server status` do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import redis

from server_mgr import process
from server_mgr.consumers import paused_reason
from tests.procs import wait_for
from tests.server_fixtures import Up, assert_the_start_ends_on_its_taken_port, sim_server, write_config
from tokenmill import keys, servers
from tokenmill.local_redis import free_port


def post(url: str, body: dict[str, object], timeout_s: float = 30.0) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def chat(url: str, max_tokens: int = 8) -> dict[str, object]:
    return post(
        url + "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens},
    )


def kinds(up: Up) -> list[str]:
    return [e["kind"] for e in reversed(up.events())]


def test_ready_server_publishes_capacity_and_comes_back_after_sigkill(tmp_path: Path, redis_url: str) -> None:
    config = write_config(
        tmp_path / "s.toml",
        sim_server(
            tmp_path, context_length=8192, enable_metrics=True, extra_args=["--max-total-tokens", "48000"]
        ),
    )
    with Up(config, redis_url) as up:
        first = up.wait_state(servers.READY)
        assert (first.max_total_num_tokens, first.context_length, first.engine) == (48000, 8192, "sim")
        assert first.url.startswith("http://127.0.0.1:") and process.is_alive(first.pid)
        assert "input_throughput" in first.live  # the warmup's Prefill line, parsed by field name
        up.wait_state(servers.READY, where=lambda r: r.live.get("kv_available_tokens") == 48000)
        wait_for(
            lambda: (
                paused_reason(up.client) is None and up.client.hexists(keys.worker_control(), "resumed_at")
            ),
            10,
            "consumers resumed",
        )

        os.kill(first.pid, signal.SIGKILL)
        again = up.wait_state(servers.READY, where=lambda r: r.restarts == 1)
        assert again.pid != first.pid and not process.is_alive(first.pid)
        assert again.last_error.startswith("killed: SIGKILLed with no crash reason in the log")
        events = ["launch", "ready", "crash", "restart", "launch", "ready"]
        wait_for(lambda: kinds(up) == events, 10, f"the events {events} (the state is set before its event)")


def test_wedged_health_endpoint_gets_the_server_restarted(tmp_path: Path, redis_url: str) -> None:
    config = write_config(tmp_path / "s.toml", sim_server(tmp_path))
    with Up(config, redis_url) as up:
        first = up.wait_state(servers.READY)
        post(first.url + "/_sim/fault", {"health_stall": True})
        again = up.wait_state(servers.READY, where=lambda r: r.restarts == 1)
        assert again.last_error.startswith("health_failed: 2 /health probes failed in a row")
        assert not process.is_alive(first.pid)


def test_a_server_that_dies_at_startup_ends_failed_not_in_an_endless_loop(
    tmp_path: Path, redis_url: str
) -> None:
    config = write_config(
        tmp_path / "s.toml",
        {
            "name": "s1",
            "port": free_port(),
            "model_path": "m",
            "log_dir": str(tmp_path / "logs"),
            "launcher": [sys.executable, "-c", "print('CUDA driver not found'); raise SystemExit(3)"],
            "max_restarts": 2,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.1,
        },
    )
    with Up(config, redis_url) as up:
        failed = up.wait_state(servers.FAILED)
        assert failed.last_error == (
            "crash loop: 3 crashes within 600 s (max_restarts = 2); "
            "last: exited: CUDA driver not found (exit 3)"
        )
        assert failed.restarts == 2 and kinds(up).count("launch") == 3
        assert up.wait_exit() == 1


def test_a_sim_crashing_on_every_request_ends_failed_with_the_crash_class(
    tmp_path: Path, redis_url: str
) -> None:
    config = write_config(
        tmp_path / "s.toml", sim_server(tmp_path, max_restarts=1, sim={"crash_after_requests": 1})
    )
    with Up(config, redis_url) as up:
        for restarts in (0, 1):
            ready = up.wait_state(servers.READY, where=lambda r, n=restarts: r.restarts == n)
            with pytest.raises(OSError):
                chat(ready.url)
        failed = up.wait_state(servers.FAILED)
        assert failed.last_error.startswith("crash loop: 2 crashes within 600 s")
        assert "scheduler_exception: a scheduler raised: RuntimeError: CUDA error" in failed.last_error


def test_a_port_taken_while_the_server_loads_ends_its_start_at_once(tmp_path: Path, redis_url: str) -> None:
    # Given a server whose port is free at launch and taken while it loads: it then logs uvicorn's
    # bind error and lingers, as SGLang does (tests/test_sglang_server.py: the same, on SGLang)
    table = sim_server(tmp_path, max_restarts=0, sim={"startup_delay_s": 4.0})
    config = write_config(tmp_path / "s.toml", table)
    with Up(config, redis_url) as up:
        up.wait_state(servers.STARTING)
        with socket.create_server(("127.0.0.1", table["port"])):
            # Then its start ends on that line, and nothing of it is left
            assert_the_start_ends_on_its_taken_port(up, table, load_timeout_s=30)


def test_startup_oom_steps_the_fraction_down_until_the_server_starts(tmp_path: Path, redis_url: str) -> None:
    config = write_config(
        tmp_path / "s.toml",
        sim_server(tmp_path, mem_fraction_static=0.9, mem_fraction_step=0.02, sim={"oom_above": 0.85}),
    )
    with Up(config, redis_url) as up:
        ready = up.wait_state(servers.READY)
        steps = [(e["previous"], e["fraction"]) for e in reversed(up.events()) if e["kind"] == "oom_step"]
        assert steps == [(0.9, 0.88), (0.88, 0.86), (0.86, 0.84)]
        assert up.client.hget(keys.server("s1"), "mem_fraction_static") == b"0.84"
        assert ready.last_error.startswith("oom_fraction_too_high: mem_fraction_static too high")
        assert "--mem-fraction-static 0.84" in up.client.hget(keys.server("s1"), "command").decode()


def test_a_fraction_too_low_is_stepped_up(tmp_path: Path, redis_url: str) -> None:
    config = write_config(
        tmp_path / "s.toml",
        sim_server(tmp_path, mem_fraction_static=0.7, mem_fraction_step=0.05, sim={"oom_below": 0.75}),
    )
    with Up(config, redis_url) as up:
        up.wait_state(servers.READY)
        steps = [(e["previous"], e["fraction"]) for e in up.events() if e["kind"] == "oom_step"]
        # the log says "Raise --mem-fraction-static above 0.750": one step past that, at once
        assert steps == [(0.7, 0.8)]


def test_server_stop_drains_in_flight_requests_and_leaves_no_process(tmp_path: Path, redis_url: str) -> None:
    config = write_config(
        tmp_path / "s.toml", sim_server(tmp_path, sim={"step_ms": 20.0, "mean_output_tokens": 2000})
    )
    with Up(config, redis_url) as up:
        ready = up.wait_state(servers.READY)
        group = set(process.group_members(ready.pid)) | {ready.pid}
        answer: dict[str, object] = {}
        streaming = threading.Thread(target=lambda: answer.update(chat(ready.url, max_tokens=60)))
        streaming.start()
        wait_for(
            lambda: up.record().live.get("running_req", 0) >= 1 or _in_flight(ready.url),
            10,
            "the request to be running",
        )

        stop = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli", "server", "stop", "--name", "s1"],
            env={**os.environ, "TOKENMILL_REDIS_URL": redis_url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert stop.stdout.splitlines() == ["s1: stop requested (drain first)", "s1: down"]
        streaming.join(10)
        assert answer["choices"][0]["finish_reason"] == "length"  # finished, not cut off
        wait_for(lambda: kinds(up)[-3:] == ["ready", "drain", "stopped"], 10, "the drain's events")
        assert up.wait_exit() == 0
        assert not [pid for pid in group if process.is_alive(pid)]
        assert paused_reason(redis.Redis.from_url(redis_url)) is not None


def _in_flight(url: str) -> bool:
    with urllib.request.urlopen(url + "/v1/loads", timeout=5) as resp:
        load = json.loads(resp.read())["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"] > 0


def test_sigterm_to_server_up_stops_every_server(tmp_path: Path, redis_url: str) -> None:
    config = write_config(tmp_path / "s.toml", sim_server(tmp_path, name="a"), sim_server(tmp_path, name="b"))
    with Up(config, redis_url) as up:
        pids = [up.wait_state(servers.READY, name=n).pid for n in ("a", "b")]
        up.proc.send_signal(signal.SIGTERM)
        assert up.wait_exit() == 0
        assert [up.record(n).state for n in ("a", "b")] == [servers.DOWN, servers.DOWN]
        assert not [pid for pid in pids if process.is_alive(pid)]


def test_a_server_orphaned_by_a_killed_manager_is_stopped_by_the_next_one(
    tmp_path: Path, redis_url: str
) -> None:
    config = write_config(tmp_path / "s.toml", sim_server(tmp_path))
    with Up(config, redis_url) as first:
        orphan = first.wait_state(servers.READY).pid
        first.proc.kill()  # the manager dies; its server, in its own session, lives on
        first.wait_exit()
        assert process.is_alive(orphan)
        with Up(config, redis_url) as second:
            ready = second.wait_state(servers.READY, where=lambda r: r.pid != orphan)
            assert not process.is_alive(orphan)
            assert "orphan" in kinds(second) and ready.restarts == 0
