"""The event loop's Redis client (``tokenmill.redis_async``) against a real redis-server: replies
matched to their callers, errors as redis-py's classes, a password and a database, a restart
mid-use, TLS (``rediss://``) through a TLS front for the same server, a host that vanishes
(through ``tests.faultproxy``), and the URL options it honours or refuses."""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import redis

from tests import certs
from tests.certs import self_signed
from tests.faultproxy import FaultProxy
from tests.procs import RedisServer
from tokenmill.errors import ConfigError
from tokenmill.redis_async import LoopRedis, LoopScript
from tokenmill.redis_conn import DEADLINES
from tokenmill.settings import Settings
from workers.event_loop import run as run_on_worker_loop


def test_replies_reach_their_own_callers_when_hundreds_are_in_flight(redis_url: str) -> None:
    async def go() -> list[bytes]:
        r = LoopRedis(redis_url)
        try:
            await asyncio.gather(*(r.call("SET", f"k{i}", f"v{i}") for i in range(300)))
            return list(await asyncio.gather(*(r.call("GET", f"k{i}") for i in range(300))))
        finally:
            r.close()

    assert run_on_worker_loop(go()) == [f"v{i}".encode() for i in range(300)]


def test_a_cancelled_caller_among_300_in_flight_leaves_every_other_caller_its_own_reply(
    redis_url: str, rclient: redis.Redis
) -> None:
    # Given 300 keys, each holding a value of its own
    rclient.mset({f"k{i}": f"v{i}" for i in range(300)})
    victim = 150

    async def go() -> tuple[int, list[object], bytes, int]:
        r = LoopRedis(redis_url)
        try:
            await r.call("PING")  # connected: the GETs below are sent as soon as they run
            calls = [asyncio.ensure_future(r.call("GET", f"k{i}")) for i in range(300)]
            await asyncio.sleep(0)  # one turn of the loop: every GET is written, none answered
            assert r._conn is not None
            in_flight = len(r._conn.waiting)
            # When one caller, in the middle of them, is cancelled before its reply comes back
            calls[victim].cancel()
            replies = await asyncio.gather(*calls, return_exceptions=True)
            after = await r.call("GET", "k7")
            return in_flight, replies, after, r.connections
        finally:
            r.close()

    in_flight, replies, after, connections = run_on_worker_loop(go())

    # Then every other caller got the value of its own key, and the connection is still in step
    assert in_flight == 300
    assert isinstance(replies[victim], asyncio.CancelledError)
    mismatched = [(i, got) for i, got in enumerate(replies) if i != victim and got != f"v{i}".encode()]
    assert not mismatched, mismatched[:5]
    assert (after, connections) == (b"v7", 1)


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


# --- a host that vanishes, and what the URL asks for ---------------------------------------------


def test_a_command_to_a_vanished_redis_fails_within_socket_timeout_and_the_replacement_is_used(
    redis_url: str,
) -> None:
    # Given the loop's client on Redis through a proxy, with socket_timeout=1 in its URL
    port = redis.connection.parse_url(redis_url)["port"]
    with FaultProxy(port) as proxy:
        url = f"redis://{proxy.address()}/0?socket_timeout=1&socket_connect_timeout=1"

        async def go() -> tuple[bytes, float, BaseException | None, BaseException | None, bytes, int]:
            r = LoopRedis(url, name="vanishing")  # a new connection's hello (its name) awaits a reply
            try:
                first = await r.call("PING")
                # When the host vanishes (the open connection goes silent, nothing is closed)
                proxy.vanish()
                # (each waited for 10 s at most, not bounded a little above its deadline: a loaded
                # machine's loop can run a timer late)
                t0 = time.monotonic()
                lost = await _error_of(asyncio.wait_for(r.call("PING"), 10))
                in_flight_s = time.monotonic() - t0
                # a new connection, never answered
                unanswered = await _error_of(asyncio.wait_for(r.call("PING"), 10))
                # and a replacement comes up at the same address
                proxy.replace()
                after = await asyncio.wait_for(r.call("PING"), 10)
                return first, in_flight_s, lost, unanswered, after, r.connections
            finally:
                r.close()

        first, in_flight_s, lost, unanswered, after, connections = run_on_worker_loop(go())
    # Then the command in flight fails by its deadline, not the kernel's, and names it
    assert first == b"PONG"
    assert isinstance(lost, redis.TimeoutError) and "socket_timeout=1" in str(lost), lost
    assert in_flight_s >= 0.9, in_flight_s
    # and a connection accepted but never answered fails by the same deadline
    assert isinstance(unanswered, redis.TimeoutError), unanswered
    # and the next command after the replacement is carried on a new connection
    assert after == b"PONG" and connections == 2


async def _error_of(aw: Awaitable[object]) -> BaseException | None:
    try:
        await aw
    except Exception as exc:
        return exc
    return None


def test_the_default_deadline_is_redis_pys_and_connections_keep_alive(redis_url: str) -> None:
    async def go() -> tuple[float | None, float, int]:
        r = LoopRedis(redis_url)
        try:
            await r.call("PING")
            assert r._conn is not None and r._conn.transport is not None
            sock = r._conn.transport.get_extra_info("socket")
            return (
                r.at.socket_timeout_s,
                r.at.connect_timeout_s,
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            )
        finally:
            r.close()

    timeout_s, connect_s, keepalive = run_on_worker_loop(go())
    # redis-py 8's defaults, which tokenmill gives its redis-py clients of older versions too
    assert timeout_s == DEADLINES["socket_timeout"] == 5
    assert connect_s == DEADLINES["socket_connect_timeout"] == 5
    defaults = inspect.signature(redis.Redis.__init__).parameters
    if defaults["socket_timeout"].default is not None:  # redis-py >= 8
        assert timeout_s == defaults["socket_timeout"].default
        assert connect_s == defaults["socket_connect_timeout"].default
    assert keepalive == 1


def test_a_connect_whose_callers_were_all_cancelled_is_not_handed_out_after_it_is_lost(
    redis_url: str, rclient: redis.Redis
) -> None:
    async def go() -> tuple[bytes, int]:
        r = LoopRedis(f"{redis_url}?socket_timeout=2", name="cancelled-connect")
        try:
            # Given a connect whose hello waits (Redis paused) and whose only caller gives up
            await asyncio.to_thread(rclient.execute_command, "CLIENT", "PAUSE", 300, "ALL")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(r.call("PING"), 0.05)
            # When the connection it made is lost
            await _until(lambda: r.connections == 1, 5)
            await asyncio.to_thread(rclient.client_kill_filter, _type=None, skipme=True, laddr=None)
            await _until(lambda: r._conn is not None and r._conn.lost, 5)
            # Then the next command opens a new one instead of waiting on the dead one
            return await asyncio.wait_for(r.call("PING"), 1.5), r.connections
        finally:
            r.close()

    assert run_on_worker_loop(go()) == (b"PONG", 2)


def test_a_connection_idle_past_health_check_interval_is_replaced_by_the_next_command(redis_url: str) -> None:
    async def go() -> tuple[int, int]:
        # Given the loop's client with health_check_interval=1 in its URL, its connection in use
        r = LoopRedis(f"{redis_url}?health_check_interval=1")
        loop = asyncio.get_running_loop()
        try:
            await r.call("PING")
            await r.call("PING")  # within the interval: the same connection
            used = r.connections
            # When the connection has then been idle past the interval
            await _until(lambda: r._conn is not None and loop.time() - r._conn.last_io > 1, 5)
            await r.call("PING")
            return used, r.connections
        finally:
            r.close()

    # Then the next command opened a new one, as redis-py's health check does
    assert run_on_worker_loop(go()) == (1, 2)


def test_a_reply_nothing_asked_for_drops_the_connection_and_the_next_command_reconnects(
    redis_url: str,
) -> None:
    async def go() -> tuple[BaseException | None, bytes, int]:
        r = LoopRedis(redis_url)
        try:
            await r.call("PING")
            assert r._conn is not None
            r._conn.data_received(b"+OK\r\n")  # as if Redis answered out of turn
            lost = await _error_of(r.call("PING")) if r._conn.lost else None
            return lost, await r.call("PING"), r.connections
        finally:
            r.close()

    lost, after, connections = run_on_worker_loop(go())
    assert lost is None  # the dropped connection is not used again: the PING went on a new one
    assert after == b"PONG" and connections == 2


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("redis://127.0.0.1:6379/0?socket_tmeout=1", "socket_tmeout"),
        ("redis://127.0.0.1:6379/0?ssl_password=x", "ssl_password"),
        ("redis+cluster://127.0.0.1:7000", "Redis Cluster"),
        ("sentinel://127.0.0.1:26379/0", "master_name"),
    ],
)
def test_a_url_option_the_client_cannot_honour_is_refused_naming_it(url: str, named: str) -> None:
    with pytest.raises(ConfigError) as refused:
        LoopRedis(url)
    assert named in str(refused.value)
    with pytest.raises(ConfigError) as also:
        Settings.load(redis_url=url)
    assert named in str(also.value)
