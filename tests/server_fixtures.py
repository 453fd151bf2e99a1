"""Helpers of the server manager's tests: fast sim configs and `server up` processes.

Redis comes from ``tests/conftest.py`` (``redis_url``, ``rclient``); every wait polls a
condition against a deadline (``tests.procs.wait_for``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from server_mgr import process
from tests.procs import wait_for
from tokenmill import keys, servers
from tokenmill.local_redis import free_port

# A sim that starts in well under a second and answers /health at once.
FAST_SIM = {
    "startup_delay_s": 0.1,
    "warmup_s": 0.05,
    "health_latency_s": 0.02,
    "health_timeout_s": 3.0,
    "drain_poll_s": 0.1,
}
FAST_SERVER = {
    "health_interval_s": 0.3,
    "health_timeout_s": 1.0,
    "health_failures": 2,
    "backoff_initial_s": 0.1,
    "backoff_max_s": 0.5,
    "stop_grace_s": 5.0,
    "drain_grace_s": 10.0,
    "startup_timeout_s": 30.0,
}


def toml_value(value: Any) -> str:
    """A Python value as TOML (strings, numbers, booleans, lists, inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def write_config(path: Path, *servers_: dict[str, Any]) -> Path:
    """A config file with one ``[[server]]`` per dict (a ``sim`` key becomes ``[server.sim]``)."""
    lines: list[str] = []
    for table in servers_:
        lines.append("[[server]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if k != "sim"]
        if "sim" in table:
            lines.append("[server.sim]")
            lines += [f"{k} = {toml_value(v)}" for k, v in table["sim"].items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def sim_server(
    tmp_path: Path, name: str = "s1", sim: dict[str, Any] | None = None, **keys: Any
) -> dict[str, Any]:
    """A fast sim ``[[server]]`` table on a free port, logging under ``tmp_path``."""
    return {
        "name": name,
        "engine": "sim",
        "port": free_port(),
        "log_dir": str(tmp_path / "logs"),
        **FAST_SERVER,
        **keys,
        "sim": {**FAST_SIM, **(sim or {})},
    }


class Up:
    """A ``tokenmill server up`` process; on exit nothing it started is left running."""

    def __init__(self, config: Path, redis_url: str, *extra: str) -> None:
        self.config = config
        self.redis_url = redis_url
        self.client = redis.Redis.from_url(redis_url)
        self.log = config.with_suffix(".up.log")
        env = {**os.environ, "TOKENMILL_REDIS_URL": redis_url}
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.cli", "server", "up", "--config", str(config), *extra],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.engine_pids: set[int] = set()

    def record(self, name: str = "s1") -> servers.ServerRecord | None:
        record = servers.load(self.client, name)
        if record and record.pid:
            self.engine_pids.add(record.pid)
        return record

    def wait_state(
        self,
        state: str,
        name: str = "s1",
        timeout_s: float = 20.0,
        where: Callable[[servers.ServerRecord], bool] = lambda r: True,
    ) -> servers.ServerRecord:
        """Wait until the record of ``name`` is in ``state`` and satisfies ``where``."""

        def ready() -> servers.ServerRecord | None:
            record = self.record(name)
            if self.proc.poll() is not None and (record is None or record.state != state):
                raise AssertionError(f"server up exited {self.proc.returncode}:\n{self.output()}")
            return record if record and record.state == state and where(record) else None

        return wait_for(ready, timeout_s, f"{name} to be {state}")

    def events(self, name: str = "s1") -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.client.lrange(keys.server_events(name), 0, -1)]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server up did not exit:\n{self.output()}") from None

    def __enter__(self) -> Up:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        for pid in self.engine_pids:  # a failed test must not leak servers
            if process.is_alive(pid):
                os.killpg(pid, signal.SIGKILL)
        self.client.close()


def assert_the_start_ends_on_its_taken_port(up: Up, table: dict[str, Any], load_timeout_s: float) -> None:
    """With ``table``'s server launched and its port then taken by another program: once the
    server logs uvicorn's bind error, the start ends at once as ``port_in_use`` (with
    ``max_restarts = 0``, failed) and nothing of the server is left. The server itself would
    linger for minutes (SGLang 0.5.23's warmup goes on asking the port for /model_info), deaf
    to SIGTERM, so a supervisor that waited for it to die fails the deadlines here."""
    log = Path(table["log_dir"]) / f"{table['name']}.log"
    pid = up.wait_state(servers.STARTING, table["name"]).pid
    assert pid is not None
    wait_for(lambda: "address already in use" in log.read_text(), load_timeout_s, "the bind error in its log")
    group = {pid, *process.descendants(pid)}
    failed = up.wait_state(servers.FAILED, table["name"], timeout_s=15)
    assert "port_in_use: the HTTP port is taken" in failed.last_error, failed.last_error
    address = f"('127.0.0.1', {table['port']})"
    assert f"error while attempting to bind on address {address}: address already in use" in failed.last_error
    wait_for(lambda: not any(process.is_alive(p) for p in group), 10, "every process of the server gone")
