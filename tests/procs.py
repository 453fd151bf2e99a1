"""Real processes for the tests: a redis-server with AOF, the sim engine, celery workers.

Every helper waits on a condition with a deadline; nothing sleeps and hopes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tokenmill.local_redis import LocalRedis, free_port

ROOT = Path(__file__).resolve().parent.parent


class PortTaken(Exception):
    """Another program answers on the port a test's server was to bind (tests.engines)."""


FATAL = (AssertionError, PortTaken)  # what a condition raises to end the wait at once


def wait_for(
    cond: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "condition",
    every: float = 0.05,
    propagate: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``cond`` until it returns a truthy value; fail naming ``what`` after ``timeout``.

    Any other exception ``cond`` raises is taken as "not checkable yet" and polled past (the
    last one is named if time runs out), except an ``AssertionError`` (a check that failed: a
    process that died, a wrong answer), ``PortTaken`` and the classes in ``propagate``: those
    end the wait at once, raised as they are."""
    fatal = (*FATAL, *propagate)
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except fatal:
            raise
        except Exception as exc:  # the condition may not be checkable yet
            last_exc = exc
        time.sleep(every)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else "")
    )


class RedisServer(LocalRedis):
    """The tests' private redis-server: ``LocalRedis`` plus a port and a password of the test's
    choosing, a client, a kill and a restart."""

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None) -> None:
        super().__init__(workdir)
        self.port = port or self.port
        self.password = password

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        return super().argv() + (["--requirepass", self.password] if self.password else [])

    def client(self, retries: int = 1) -> redis.Redis:
        """redis-py's own client with its defaults (the tests' view of Redis, not tokenmill's)."""
        return redis.Redis.from_url(self.url)

    def kill(self, sig: int = 9) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


def http_status(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
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
    fh = open(log, "ab")
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT, **kw)
    return Proc(proc, log)


def sim_stats(url: str) -> dict[str, Any]:
    """The sim's ``GET /_sim/stats`` (its scheduler's internals and what it answered)."""
    with urllib.request.urlopen(f"{url}/_sim/stats", timeout=5) as resp:
        stats: dict[str, Any] = json.loads(resp.read())
    return stats


def start_sim(workdir: Path, *extra: str, port: int | None = None) -> tuple[Proc, str]:
    """The sim engine on a free port, ready (``/health`` 200); returns (process, base URL)."""
    port = port or free_port()
    args = [
        sys.executable,
        "-m",
        "server_mgr.sim",
        "--port",
        str(port),
        "--sim-startup-delay-s",
        "0",
        "--sim-warmup-s",
        "0",
        "--sim-health-latency-s",
        "0.01",
        "--sim-step-ms",
        "2",
        "--sim-step-ms-per-req",
        "0.01",
        "--sim-mean-output-tokens",
        "40",
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


def start_worker(
    workdir: Path,
    queue: str,
    env: dict[str, str],
    concurrency: int = 8,
    name: str | None = None,
    via_celery: bool = False,
) -> Proc:
    """A real ``celery worker`` process (threads pool) on ``queue``, ready to consume."""
    name = name or f"{queue}-{free_port()}"
    if via_celery:
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tokenmill.app",
            "worker",
            "-Q",
            queue,
            "-P",
            "threads",
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "INFO",
        ]
    else:
        args = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "worker",
            "--queue",
            queue,
            "--concurrency",
            str(concurrency),
            "--hostname",
            f"{name}@%h",
        ]
    proc = spawn(args, workdir / f"worker-{name}.log", env=env)
    wait_for(lambda: " ready." in proc.output() or not proc.alive(), 60, f"worker {name} ready")
    assert proc.alive(), proc.output()
    return proc


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def start_s3(workdir: Path) -> tuple[Proc, dict[str, str]]:
    """A real S3-compatible HTTP server (moto's server mode) on a loopback port; returns it and
    the environment that points boto/s3fs at it (``AWS_ENDPOINT_URL`` and test credentials)."""
    port = free_port()
    proc = spawn(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], workdir / "s3.log"
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(
        lambda: http_status(f"{url}/moto-api/") == 200 or not proc.alive(), 60, f"the S3 server on {url}"
    )
    assert proc.alive(), proc.output()
    return proc, {**S3_ENV, "AWS_ENDPOINT_URL": url}
