"""`tokenmill server up` supervising real SGLang 0.5.23 (the tiny CPU model of `make sglang-env`):
readiness, capacity, live figures from its real log lines and /metrics, restarts after a killed
launcher or a killed scheduler with nothing orphaned, a stop that leaves nothing, startup failures
classified from its real log, and the quality gate between two real configurations."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from server_mgr import process
from tests.engines import API_KEY, CONTEXT_LEN, SGLANG_READY_S, EnginePool, sglang_server
from tests.pipeline import cli, write_jsonl
from tests.procs import wait_for
from tests.server_fixtures import Up, assert_the_start_ends_on_its_taken_port, write_config
from tokenmill import servers

pytestmark = pytest.mark.sglang


def chat(url: str, i: int, max_tokens: int) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": f"story {i}: tell it"}], "max_tokens": max_tokens}
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        return json.loads(resp.read())


def children(pid: int) -> dict[str, int]:
    """A launcher's children by their SGLang titles."""
    out = {}
    for child in process.descendants(pid):
        try:
            title = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if title.startswith("sglang::"):
            out[title] = child
    return out


def test_server_up_publishes_real_capacity_and_live_figures_and_stop_leaves_nothing(
    tmp_path: Path, redis_url: str
) -> None:
    # Given a config for real SGLang with /metrics on and a KV pool small enough to fill up
    table = sglang_server(tmp_path, enable_metrics=True, extra=["--max-total-tokens", "4000"])
    config = write_config(tmp_path / "s.toml", table)
    with Up(config, redis_url) as up:
        # When it is up: ready by /health, with the capacity the real server states
        ready = up.wait_state(servers.READY, timeout_s=300)
        assert (ready.max_total_num_tokens, ready.context_length, ready.engine) == (
            4000,
            CONTEXT_LEN,
            "sglang",
        )
        assert set(children(ready.pid)) == {"sglang::scheduler", "sglang::detokenizer"}
        group = {ready.pid, *process.descendants(ready.pid)}

        # And 64 requests of 200 tokens overfill its pool
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            load = [pool.submit(chat, ready.url, i, 200) for i in range(64)]
            # Then while they run, the live figures come from its real Decode lines ("cpu graph")
            busy = up.wait_state(
                servers.READY, timeout_s=300, where=lambda r: r.live.get("gen_throughput", 0) > 0
            ).live
            done = [f.result() for f in load]
        assert sum(d["usage"]["completion_tokens"] for d in done) > 4000
        assert busy["graph"] == 0.0, busy  # "cpu graph: False" read like "cuda graph"

        # And from /metrics, retractions included (a count the log and /metrics both keep)
        log = Path(table["log_dir"]) / "s1.log"
        try:
            live = up.wait_state(
                servers.READY, timeout_s=30, where=lambda r: r.live.get("retractions", 0) >= 1
            ).live
        except AssertionError as exc:  # say whether the server retracted, and what was published
            retracts = [x for x in log.read_text().splitlines() if "Retract requests" in x]
            raise AssertionError(f"{exc}; record {up.record()}; the server's log: {retracts[:3]}") from None
        assert "kv_available_tokens" in live and "num_used_tokens" in live, live  # /metrics
        assert "KV cache pool is full. Retract requests." in log.read_text()

        # And `server stop` drains it and leaves no process of it
        cli("server", "stop", "--config", str(config), env={"TOKENMILL_REDIS_URL": redis_url}, timeout=120)
        up.wait_state(servers.DOWN, timeout_s=120)
        assert up.wait_exit(120) == 0
        wait_for(lambda: not any(process.is_alive(p) for p in group), 30, "every process of the server gone")


def test_a_killed_launcher_or_scheduler_is_restarted_with_nothing_orphaned(
    tmp_path: Path, redis_url: str
) -> None:
    config = write_config(tmp_path / "s.toml", sglang_server(tmp_path, extra=["--max-total-tokens", "20000"]))
    with Up(config, redis_url) as up:
        first = up.wait_state(servers.READY, timeout_s=300)
        first_group = {first.pid, *process.descendants(first.pid)}
        assert len(first_group) >= 3

        # When the launcher is SIGKILLed, its children die with it and a new server comes up
        os.kill(first.pid, signal.SIGKILL)
        second = up.wait_state(servers.READY, timeout_s=300, where=lambda r: r.restarts == 1)
        assert second.pid != first.pid
        assert not any(process.is_alive(p) for p in first_group), "an orphan of the killed launcher"
        assert second.last_error.startswith("killed: SIGKILLed with no crash reason in the log")

        # When only its scheduler child is SIGKILLed, the launcher's own watchdog takes the server
        # down, the manager sees why in the log, and restarts it
        second_group = {second.pid, *process.descendants(second.pid)}
        scheduler = children(second.pid)["sglang::scheduler"]
        os.kill(scheduler, signal.SIGKILL)
        third = up.wait_state(servers.READY, timeout_s=300, where=lambda r: r.restarts == 2)
        assert third.last_error.startswith(
            "subprocess_crashed: a child process died: Subprocess scheduler_0"
        ), third.last_error
        assert not any(process.is_alive(p) for p in second_group), "an orphan of the crashed server"
        assert chat(third.url, 1, 8)["usage"]["completion_tokens"] == 8


def test_a_value_sglang_refuses_fails_at_once_naming_it(tmp_path: Path, redis_url: str) -> None:
    config = write_config(tmp_path / "s.toml", sglang_server(tmp_path, extra=["--schedule-policy", "bogus"]))
    with Up(config, redis_url) as up:
        failed = up.wait_state(servers.FAILED, timeout_s=300)
        assert failed.last_error.startswith("invalid_arguments: SGLang refused its arguments"), (
            failed.last_error
        )
        assert "argument --schedule-policy: invalid choice: 'bogus'" in failed.last_error
        assert failed.restarts == 0


def test_a_port_taken_while_sglang_loads_ends_its_start_at_once(tmp_path: Path, redis_url: str) -> None:
    # Given SGLang launched on a free port that another program takes while SGLang loads (it binds
    # its port only after the model is loaded; then uvicorn fails, but the process lives on for
    # minutes, its warmup asking the taken port for /model_info, deaf to SIGTERM)
    table = sglang_server(tmp_path, max_restarts=0, extra=["--max-total-tokens", "4000"])
    config = write_config(tmp_path / "s.toml", table)
    with Up(config, redis_url) as up:
        up.wait_state(servers.STARTING, timeout_s=60)
        with socket.create_server(("127.0.0.1", table["port"])):
            # Then the manager ends the start on SGLang's bind error, and nothing of it is left
            assert_the_start_ends_on_its_taken_port(up, table, load_timeout_s=SGLANG_READY_S)


def test_a_kv_pool_that_cannot_exist_is_read_from_the_log_and_not_stepped_in_vain(
    tmp_path: Path, redis_url: str
) -> None:
    # Given an impossible --max-total-tokens: SGLang says "Not enough memory. Please try to
    # increase --mem-fraction-static", but sizes the pool from that flag alone
    config = write_config(tmp_path / "s.toml", sglang_server(tmp_path, extra=["--max-total-tokens=-8"]))
    with Up(config, redis_url) as up:
        # Then the manager reads the class from the real log and stops at once, naming the flag,
        # instead of stepping mem_fraction_static through its bounds
        failed = up.wait_state(servers.FAILED, timeout_s=300)
        assert failed.last_error.startswith(
            "oom_fraction_too_low: mem_fraction_static too low: RuntimeError: Not enough memory."
        ), failed.last_error
        assert "set by --max-total-tokens -8 in extra_args" in failed.last_error
        assert [e for e in up.events() if e["kind"] == "oom_step"] == []


def test_check_quality_finds_bf16_and_fp32_diverge_and_passes_an_equal_server(
    tmp_path: Path, redis_url: str, engine_pool: EnginePool
) -> None:
    # Given the session's shared float32 server as the reference (a running server, with its key),
    # another float32 server (the shared one with a tool-call parser, which acts only on requests
    # with tools), and a config that launches the same model in bfloat16
    reference = engine_pool.shared("sglang", "plain")
    equal = engine_pool.shared("sglang", "tools")
    prompts = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"quality {i}: explain"} for i in range(8)])
    table = sglang_server(tmp_path, name="bf16", extra=["--max-total-tokens", "20000", "--dtype", "bfloat16"])
    bf16_toml = write_config(tmp_path / "bf16.toml", table)
    env = {"TOKENMILL_REDIS_URL": redis_url}
    args = ["--reference-url", reference.url, "--api-key", API_KEY, "--prompts", str(prompts)]
    args += ["--max-tokens", "64", "--json"]

    # When each is compared with the reference: the running server, then the config, launched
    same = cli(
        "server", "check-quality", *args, "--candidate-url", equal.url, env=env, check=False, timeout=600
    )
    bf16 = cli(
        "server", "check-quality", *args, "--candidate", str(bf16_toml), env=env, check=False, timeout=600
    )

    # Then the equal server passes with every output equal, and bfloat16 fails, diverging
    for name, out in (("equal", same), ("bfloat16", bf16)):
        assert out.stdout.strip(), f"{name}: no report (exit {out.returncode}): {out.stderr[-3000:]}"
    same_doc, bf16_doc = json.loads(same.stdout), json.loads(bf16.stdout)
    assert same.returncode == 0 and same_doc["passed"] and same_doc["exact_match_rate"] == 1.0, same.stdout
    assert bf16.returncode != 0 and not bf16_doc["passed"], bf16.stdout
    assert bf16_doc["diverged"] >= 1 and bf16_doc["exact_match_rate"] < 1.0
