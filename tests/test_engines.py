"""tests.engines' own guards, on the sim: what keeps the real-SGLang tier honest."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest

from tests import engines
from tests.engines import assert_not_the_sim, running_engine, start_engine
from tests.procs import http_status
from tokenmill.local_redis import free_port


def test_an_engine_started_as_sglang_that_turns_out_to_be_the_sim_fails_loudly(tmp_path: Path) -> None:
    # Given the sim, running with an API key as the real engines are
    with running_engine("sim", tmp_path, api_key="k") as sim:
        # When the check each real SGLang start runs is run on it, as if it had been started as SGLang
        with pytest.raises(AssertionError) as unmasked:
            assert_not_the_sim(replace(sim, kind="sglang"))

    # Then it fails, saying which engine and why
    assert f"the engine started as real SGLang on {sim.url} is not SGLang" in str(unmasked.value)
    assert "GET /_sim/stats answered 200" in str(unmasked.value)


def test_an_engine_whose_free_port_is_taken_while_it_loads_starts_again_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a port another program holds, handed to the next launch as free (as happens when
    # something binds a free port while SGLang loads, before SGLang binds it)
    with socket.create_server(("127.0.0.1", 0)) as taker:
        taken = taker.getsockname()[1]
        ports = iter([taken, free_port()])
        monkeypatch.setattr(engines, "late_bound_port", lambda: next(ports))

        # When an engine is started (the first launch would log uvicorn's bind error and linger,
        # deaf to SIGTERM, as SGLang does; the stranger on its port never answers /health)
        engine = start_engine("sim", tmp_path)
        try:
            # Then it was launched again on the other port, and answers there
            assert engine.port != taken and http_status(f"{engine.url}/health") == 200
            # And nothing of the first launch is left
            launched_there = [p for p in Path("/proc").glob("[0-9]*") if f"--port {taken} " in _cmdline(p)]
            assert not launched_there
        finally:
            engine.stop()


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
