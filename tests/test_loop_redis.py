"""The event loop's Redis client (``tokenmill.loop_redis``) against a real redis-server: replies
matched to their callers, errors as redis-py's classes, a password and a database, a restart
mid-use, and TLS (``rediss://``) through a TLS front for the same server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests import certs
from tests.certs import self_signed
from tests.procs import RedisServer
from tokenmill.loop_redis import LoopRedis, LoopScript
from workers.loop import run as run_on_worker_loop


def test_replies_reach_their_own_callers_when_hundreds_are_in_flight(redis_url: str) -> None:
    async def go() -> list[bytes]:
        r = LoopRedis(redis_url)
        try:
            await asyncio.gather(*(r.call("SET", f"k{i}", f"v{i}") for i in range(300)))
            return list(await asyncio.gather(*(r.call("GET", f"k{i}") for i in range(300))))
        finally:
            r.close()

    assert run_on_worker_loop(go()) == [f"v{i}".encode() for i in range(300)]


def test_an_error_reply_is_a_response_error_and_a_missing_script_is_loaded(
    redis_url: str, rclient: redis.Redis
) -> None:
    script = LoopScript("return redis.call('INCRBY', KEYS[1], ARGV[1])")

    async def go() -> tuple[int, int, str]:
        r = LoopRedis(redis_url)
        try:
            first = await r.evalsha(script, ["n"], [2])
            await r.call("SCRIPT", "FLUSH")  # as after a Redis restart
            again = await r.evalsha(script, ["n"], [3])
            try:
                await r.call("INCR", "not-a-number-key-holds-text")
            except redis.ResponseError as exc:
                return first, again, str(exc)
            return first, again, ""
        finally:
            r.close()

    rclient.set("not-a-number-key-holds-text", "text")
    assert run_on_worker_loop(go()) == (2, 5, "ERR value is not an integer or out of range")


def test_a_password_and_a_database_are_used_and_a_wrong_password_is_an_authentication_error(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "guarded", password="s3cret").start()
    try:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"

        async def go() -> bytes:
            r = LoopRedis(url, name="probe")
            try:
                await r.call("SET", "where", "db3")
                return await r.call("CLIENT", "GETNAME")
            finally:
                r.close()

        assert run_on_worker_loop(go()) == b"probe"
        assert redis.Redis.from_url(url).get("where") == b"db3"
        assert redis.Redis.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/0").get("where") is None

        async def wrong() -> None:
            r = LoopRedis(f"redis://:nope@127.0.0.1:{server.port}/0")
            try:
                await r.call("PING")
            finally:
                r.close()

        with pytest.raises(redis.AuthenticationError):
            run_on_worker_loop(wrong())
    finally:
        server.kill()


def test_a_restart_fails_the_commands_in_flight_and_the_next_command_reconnects(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "restarted").start()
    try:

        async def go() -> tuple[BaseException | None, bytes, int]:
            r = LoopRedis(server.url)
            try:
                blocked = asyncio.ensure_future(r.call("BLPOP", "nothing", 0))  # in flight
                await _until(lambda: b"cmd=blpop" in server.client().execute_command("CLIENT", "LIST"))
                await asyncio.to_thread(server.kill)
                failure = None
                try:
                    await blocked
                except redis.ConnectionError as exc:
                    failure = exc
                await asyncio.to_thread(server.start)
                await r.call("SET", "after", "restart")
                return failure, await r.call("GET", "after"), r.connections
            finally:
                r.close()

        failure, after, connections = run_on_worker_loop(go())
        assert isinstance(failure, redis.ConnectionError) and "lost" in str(failure)
        assert after == b"restart" and connections == 2
    finally:
        server.kill()


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(cond):
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.01)


@pytest.fixture
def tls_front(redis_url: str, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A TLS front for the session's redis-server: (its port, the CA file that verifies it)."""
    with certs.tls_front(redis.connection.parse_url(redis_url)["port"], tmp_path) as front:
        yield front


def test_rediss_verifies_the_servers_certificate_against_the_ca_given(
    tls_front: tuple[int, Path], rclient: redis.Redis, tmp_path: Path
) -> None:
    port, ca = tls_front
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"

    async def go(u: str) -> bytes:
        r = LoopRedis(u)
        try:
            await r.call("SET", "over", "tls")
            return await r.call("GET", "over")
        finally:
            r.close()

    assert run_on_worker_loop(go(url)) == b"tls"
    assert redis.Redis.from_url(url).get("over") == b"tls"  # the worker's other client agrees
    _, _, other_ca = self_signed(tmp_path / "other")
    with pytest.raises(redis.ConnectionError) as refused:
        run_on_worker_loop(go(f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={other_ca}"))
    assert "certificate verify failed" in str(refused.value)
