"""Session fixtures: one private redis-server (AOF on) for the session, flushed per test."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.procs import Proc, RedisServer, start_s3


def pytest_configure(config: pytest.Config) -> None:
    """Tests Ctrl-C child processes (`status --watch`, `server up`). A suite started in the
    background by a non-interactive shell has SIGINT ignored, and an ignored signal stays ignored
    across exec: catch it here, so that children start with the default disposition."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean database on the session's redis-server."""
    if not redis_server.ping():
        redis_server.start()
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def rclient(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    """Processes a test starts; all are stopped (then killed) when it ends."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop(timeout=10)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real S3-compatible server (moto, server mode) on loopback for the session: the
    environment variables that point a client at it."""
    proc, env = start_s3(tmp_path_factory.mktemp("s3"))
    yield env
    proc.kill()


@pytest.fixture
def s3_env(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``s3_server``'s environment, also set in this process (s3fs reads it from there)."""
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    return s3_server
