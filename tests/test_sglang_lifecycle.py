"""A server's life as a supervisor sees it, one test body for the sim and SGLang 0.5.23: startup,
a SIGTERM drain, and the death of its scheduler process. Each test starts an engine of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from tests.engines import ENGINE_PARAMS, start_engine
from tests.procs import http_status, wait_for
from tests.sglang_client import client
from workers.event_loop import run as run_on_worker_loop
from workers.stream import Progress, stream_chat

FIRED_UP = "The server is fired up and ready to roll!"


# One engine's life from launch to SIGTERM (one start where two tests took two: ~30 s of SGLang)
LIFE_SIM = ("--sim-warmup-s", "1.5", "--sim-drain-poll-s", "0.5", "--sim-step-ms", "10")


@pytest.mark.parametrize("kind", ENGINE_PARAMS)
def test_health_is_refused_then_503_until_warmup_then_200_and_sigterm_drains_a_stream_then_exits_0(
    kind: str, tmp_path: Path
) -> None:
    # Given an engine just launched (the sim's warmup as long as SGLang's first /generate)
    engine = start_engine(kind, tmp_path, wait_ready=False, sim_flags=LIFE_SIM)
    try:
        # When /health and /v1/models are polled until /health answers 200
        seen: list[tuple[int, int]] = []

        def healthy() -> bool:
            assert engine.alive(), engine.output()[-3000:]
            seen.append((http_status(f"{engine.url}/health", 25), http_status(f"{engine.url}/v1/models", 25)))
            return seen[-1][0] == 200

        wait_for(healthy, 240, f"{kind} to become healthy", every=0.1)
        log = engine.output()

        # Then the port was refused first, /v1/models answered while /health was still 503,
        # and /health turned 200 only after the fired-up line
        assert seen[0] == (0, 0), seen[:5]
        assert (503, 200) in seen, sorted(set(seen))
        assert FIRED_UP in log
        assert engine.children().keys() == {"sglang::scheduler", "sglang::detokenizer"}

        # And when the main process gets SIGTERM while it streams a request
        async def stream_through_a_sigterm() -> Progress:
            c = client(engine)
            progress = Progress()
            request = {"model": "tm", "messages": [{"role": "user", "content": "go"}], "max_tokens": 300}
            task = asyncio.ensure_future(stream_chat(c, request, {}, progress))
            while progress.tokens < 3:
                assert not task.done(), task.exception()
                await asyncio.sleep(0.01)
            os.kill(engine.pid, signal.SIGTERM)
            await asyncio.sleep(0.3)
            health = await asyncio.to_thread(http_status, f"{engine.url}/health", 10)
            assert health in (503, 0), health
            await task
            await c.close()
            return progress

        progress = run_on_worker_loop(stream_through_a_sigterm())

        # Then the stream ran to its end, /health said 503 meanwhile, and the engine exited 0
        # leaving nothing
        assert progress.finish_reason == "length" and progress.tokens == 300
        wait_for(lambda: not engine.alive(), 60, "the drained engine to exit")
        assert engine.proc.returncode() == 0, engine.output()[-3000:]
        assert "SIGTERM received" in engine.output()
        wait_for(lambda: engine.leftovers() == [], 10, "every process of the engine to be gone")
    finally:
        if engine.alive():
            engine.stop()


@pytest.mark.parametrize("kind", ENGINE_PARAMS)
def test_a_dead_scheduler_fails_health_and_takes_the_whole_server_down(kind: str, tmp_path: Path) -> None:
    # Given a ready engine with its scheduler and detokenizer processes
    engine = start_engine(kind, tmp_path)
    engine.proc.remember_members()
    assert len(engine.proc.seen) >= 3, engine.proc.seen

    # When its scheduler process is SIGKILLed
    pid = engine.kill_child("sglang::scheduler")
    killed_at = time.monotonic()

    # Then /health stops answering 200 at once, the main process kills the tree (itself
    # included: -9) within seconds, saying which child died, and nothing is left
    wait_for(lambda: http_status(f"{engine.url}/health", 3) != 200, 10, "/health to fail")
    wait_for(lambda: not engine.alive(), 60, "the main process to exit")
    assert engine.proc.returncode() == -signal.SIGKILL
    assert f"Subprocess scheduler_0 (pid={pid}) crashed with exit code -9" in engine.output()
    assert time.monotonic() - killed_at < 60
    wait_for(lambda: engine.leftovers() == [], 10, "every process of the engine to be gone")
