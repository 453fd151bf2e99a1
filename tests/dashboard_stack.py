"""A demo-like run for the dashboard's tests, and headless Chromium to look at it.

The run: the bundled demo dataset (partitions B1 and B2, as ``tokenmill demo`` enqueues them) and a
partition of prompts too long for the server's context (they fail, class ``context_length``),
served by the sim under the server manager (``tokenmill server up``: state, restarts; the sim
crashes once mid-run and is restarted), a short and a long worker recording history points every
second, the sealer, and ``tokenmill dashboard`` behind basic auth. Chromium is Debian's, driven
through its chromedriver by Selenium; nothing is downloaded (``make browser-env`` installs both).
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from tests.pipeline import cli, write_jsonl
from tests.procs import Proc, http_status, spawn, wait_for, worker_env
from tests.server_fixtures import FAST_SERVER, FAST_SIM, Up, write_config
from tokenmill.local_redis import free_port

RUN = "dash"
USER, PASSWORD = "ops", "s3cret-pw"
CONTEXT_LENGTH = 1024
TOO_LONG = 5  # prompts longer than the context: they fail
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1400,1000",
]


@dataclass
class Stack:
    """Everything the run needs, started in order; ``close`` stops it all."""

    workdir: Path
    redis_url: str
    up: Up | None = None
    procs: list[Proc] = field(default_factory=list)
    dashboard_url: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def start_server(self) -> None:
        """The sim under ``tokenmill server up``, ready."""
        server = {
            "name": "sim-1",
            "engine": "sim",
            "port": free_port(),
            "log_dir": str(self.workdir / "logs"),
            "reasoning_parser": "qwen3",
            "context_length": CONTEXT_LENGTH,
            **FAST_SERVER,
            "sim": {**FAST_SIM, "step_ms": 8.0, "mean_output_tokens": 100, "crash_after_requests": 120},
        }
        self.up = Up(write_config(self.workdir / "servers.toml", server), self.redis_url)
        record = self.up.wait_state("ready", name="sim-1", timeout_s=60)
        self.env = {
            "TOKENMILL_REDIS_URL": self.redis_url,
            "TOKENMILL_SERVER_URL": record.url,
            "TOKENMILL_RESULTS_URL": str(self.workdir / "results"),
        }

    def start_dashboard(self) -> None:
        port = free_port()
        env = {**self.env, "TOKENMILL_DASHBOARD_BASIC_AUTH": f"{USER}:{PASSWORD}"}
        proc = spawn(
            [sys.executable, "-m", "tokenmill.cli", "dashboard", "--port", str(port)],
            self.workdir / "dashboard.log",
            env=env,
        )
        self.procs.append(proc)
        self.dashboard_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_status(self.dashboard_url) == 401 or not proc.alive(), 30, "the dashboard")
        assert proc.alive(), proc.output()

    def enqueue(self) -> None:
        """The demo's dataset, as ``tokenmill demo`` enqueues it, and the prompts that fail."""
        data = resources.files("tokenmill").joinpath("data/demo")
        files = [str(data.joinpath(f"{p}.jsonl")) for p in ("B1", "B2")]
        long_rows = [{"id": f"x{i}", "prompt": "tell me everything " * 600} for i in range(TOO_LONG)]
        files.append(str(write_jsonl(self.workdir / "X.jsonl", long_rows)))
        flags = ["--short-max-tokens", "256", "--long-max-tokens", "512", "--long-prompt-tokens", "18"]
        cli("enqueue", *files, "--run", RUN, *flags, env=self.env)

    def start_workers(self) -> None:
        """A short and a long worker (recording a history point a second) and the sealer."""
        env = {**worker_env(self.redis_url, self.env["TOKENMILL_SERVER_URL"]), "TOKENMILL_SERIES_STEP_S": "1"}
        env["TOKENMILL_CHECKPOINT_EVERY_TOKENS"] = "64"
        procs = [
            spawn(_worker_argv("short", 24), self.workdir / "worker-short.log", env=env),
            spawn(_worker_argv("long", 8), self.workdir / "worker-long.log", env=env),
        ]
        self.procs += procs
        for p in procs:
            wait_for(lambda p=p: " ready." in p.output() or not p.alive(), 60, "a worker ready")
            assert p.alive(), p.output()
        seal_env = {**self.env, "TOKENMILL_SEAL_CHECK_S": "0.5"}
        seal = [sys.executable, "-m", "tokenmill.cli", "seal"]
        self.procs.append(spawn(seal, self.workdir / "seal.log", seal_env))

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop(timeout=10)
        if self.up is not None:
            self.up.__exit__(None, None, None)


def _worker_argv(queue: str, concurrency: int) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "worker", "-Q", queue, "--concurrency", str(concurrency)]


def _which(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if path is None:
        pytest.fail(f"{name} is not installed: `make browser-env` installs Debian's chromium and its driver")
    return path


def basic_auth(user: str = USER, password: str = PASSWORD) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@contextlib.contextmanager
def chromium(authorization: str | None = None) -> Iterator[Any]:
    """Headless Chromium under Selenium, a fresh profile, its console log kept; every request it
    makes carries ``authorization`` (set through the DevTools protocol)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _which("chromium")
    profile = tempfile.mkdtemp(prefix="tokenmill-chromium-")
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(_which("chromedriver")))
    try:
        driver.execute_cdp_cmd("Network.enable", {})
        if authorization:
            headers = {"headers": {"Authorization": authorization}}
            driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", headers)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
