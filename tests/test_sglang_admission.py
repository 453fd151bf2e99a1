"""The closed loop of admission on both engines, the sim and SGLang 0.5.23: a worker with far more
threads than the server's KV pool can serve at once, and no concurrency tuned by hand."""

from __future__ import annotations

import statistics
import threading
from pathlib import Path

import pytest
import redis

from tests.chaos import state_counts, wait_finished
from tests.engines import ENGINE_PARAMS, running_engine
from tests.pipeline import cli, write_jsonl
from tests.procs import Proc, start_worker, worker_env
from tokenmill import keys
from tokenmill.admission_view import admission_view, read_survival


@pytest.mark.parametrize("kind", ENGINE_PARAMS)
def test_the_window_follows_the_servers_own_figures_and_keeps_its_queue_short(
    kind: str, tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a server with a 4,000-token KV pool and a worker with 64 threads
    flags = ("--max-total-tokens", "4000", "--enable-metrics")
    with running_engine(kind, tmp_path, *flags, sim_flags=("--sim-step-ms", "10")) as engine:
        rows = [{"prompt": f"topic {i}: " + "context " * (20 + i % 40)} for i in range(64)]
        env = worker_env(redis_url, engine.url, admission_poll_s=0.25)
        cli("enqueue", str(write_jsonl(tmp_path / "P.jsonl", rows)), "--run", "loop", "--temperature", "0",
            "--short-max-tokens", "150", env=env)  # fmt: skip

        # When it runs, while admission is watched
        samples: list[dict] = []
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.25):
                samples.append(admission_view(rclient, engine.url))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        procs.append(start_worker(tmp_path, "short", env, concurrency=64))
        wait_finished(rclient, "loop", 64, 300)
        done.set()
        watcher.join(5)

    # Then every job is done; the window, not the 64 threads nor the token guard, decided, and
    # it was steered by the server's figures (one reader for the worker's threads)
    assert state_counts(rclient, "loop") == {"queued": 0, "running": 0, "done": 64, "failed": 0}
    steered = [s for s in samples if s.get("rule") == "window" and s.get("n", 0) > 0]
    assert len(steered) >= len(samples) // 2, samples[-5:]
    assert max(s["window"] for s in steered) < 64
    # (past the window only the run's tail, which starts at once when it fits until it ends)
    trace = [
        (s["n"], s.get("tail", 0), s["window"], s["srv_running"], s["srv_waiting"], s["srv_used"])
        for s in steered
    ]
    assert max(n - tail for n, tail, *_ in trace) <= max(s["window"] for s in steered), trace
    assert any(s.get("srv_running", 0) > 0 for s in steered)
    # and a short queue waited on the server: enough to keep it busy, not the whole backlog
    waiting = [s["srv_waiting"] for s in steered]
    assert statistics.median(waiting) <= 8, trace
    # and every request reported its prompt as the server counted it, so the projection holds
    # prompts at the server's size (SGLang's tokenizer took each "context " as one token, not the
    # estimate's two; the sim counts a template's tokens more), not at the estimate's
    lengths = rclient.hgetall(keys.RunKeys("loop").lengths())
    stats = rclient.hgetall(keys.RunKeys("loop").stats())
    assert int(lengths[b"pn"]) == 64 and int(lengths[b"pk"]) == int(stats[b"prompt_tokens"])
    offset = read_survival(rclient, "loop").prompt_offset
    assert offset == (int(lengths[b"pk"]) - int(lengths[b"pe"])) / 64 and offset != 0
