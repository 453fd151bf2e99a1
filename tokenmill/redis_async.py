"""Redis from an event loop: commands pipelined on one connection, replies parsed by hiredis.

The worker runs a job's ledger transitions on its event loop, beside the job's stream
(:mod:`workers.job_path`). Through redis-py's asyncio client a command cost that loop 95-118 µs of
CPU; here it costs 9-26 µs (one ``hiredis.pack_command``, a write, and a reply parsed in the
connection's ``data_received``; measured on this machine class, docs/benchmarks-history/short-outputs.md).
Every command of a process shares one connection: replies come back in the order the commands were
sent, so each caller's future is the next one waiting.

Only what the worker's transitions need: commands, ``EVALSHA`` with a load on ``NOSCRIPT``,
redis-py's URL forms (``redis://``, ``rediss://`` with its ``ssl_*`` options, ``unix://``) and
Sentinel's (:mod:`tokenmill.redis_url`: the primary is asked of the sentinels on each new
connection, which must then say it is a master), ``AUTH``, ``SELECT``, a client name, and
scripts loaded on each new connection. Errors are redis-py's own classes, so callers handle both
clients alike: an error reply is a ``ResponseError`` (``NoScriptError`` for ``NOSCRIPT``), a
lost or refused connection a ``ConnectionError``, a command unanswered for ``socket_timeout`` a
``TimeoutError``. A lost connection fails the commands in flight and the next command opens a
new one.

The same promises as redis-py's connections (``socket_timeout`` and ``socket_connect_timeout``
from the URL, 5 s each by default; TCP keepalive on; ``health_check_interval``), so that a Redis
host that vanishes without a word (a failover, a NAT that forgot the connection) costs a
command its deadline, not the kernel's retransmission limit. The deadline is one timer per
connection, armed while replies are awaited and pushed on by each reply that arrives: a command
costs no timer of its own. Options of redis-py's URL that do not apply to one pipelined
connection are accepted (``max_connections``, ``retry_on_timeout``, ...); one it does not know is
refused, naming it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
from collections import deque
from collections.abc import Iterable
from typing import Any

import hiredis
import redis

from tokenmill import redis_url

log = logging.getLogger("tokenmill.redis")
# TCP keepalive: first probe after 30 s idle, then every 10 s, 3 unanswered drop the connection
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}


class LoopScript:
    """A Lua script known by its SHA1, sent as ``EVALSHA`` and loaded when Redis lacks it."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class _Protocol(asyncio.Protocol):
    """One connection: replies matched to the futures waiting, in order, under one deadline."""

    transport: asyncio.Transport  # set by connection_made, before the connection is handed out

    def __init__(self, timeout_s: float | None) -> None:
        self.reader = hiredis.Reader()
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.lost = False
        self.timeout_s = timeout_s
        self.last_io = 0.0  # when a command was sent to an idle connection, or a reply came
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        while (reply := self.reader.gets()) is not False:
            if not waiting:  # nothing asked for it: the stream is out of step, trust none of it
                self._abort(redis.ConnectionError("Redis sent a reply nothing asked for; connection dropped"))
                return
            fut = waiting.popleft()
            if fut.done():  # its caller was cancelled; the reply is read all the same
                continue
            if isinstance(reply, hiredis.ReplyError):
                fut.set_exception(_error(reply))
            else:
                fut.set_result(reply)
        self.last_io = asyncio.get_running_loop().time()

    def connection_lost(self, exc: Exception | None) -> None:
        why = f"the connection to Redis was lost{f': {exc}' if exc else ''}"
        self._fail_all(redis.ConnectionError(why))

    def send(self, command: tuple[Any, ...]) -> asyncio.Future[Any]:
        packed = hiredis.pack_command(command)  # first: a command it cannot pack is not sent, nor awaited
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.waiting:
            self.last_io = loop.time()
            if self._timer is None and self.timeout_s:
                self._timer = loop.call_at(self.last_io + self.timeout_s, self._check)
        self.waiting.append(fut)
        self.transport.write(packed)
        return fut

    def _check(self) -> None:
        """The deadline: a reply awaited and nothing heard for ``timeout_s``: drop the connection."""
        self._timer = None
        if not self.waiting or self.lost or not self.timeout_s:
            return
        loop = asyncio.get_running_loop()
        due = self.last_io + self.timeout_s
        if loop.time() < due:
            self._timer = loop.call_at(due, self._check)
            return
        self._abort(redis.TimeoutError(f"Redis did not answer within socket_timeout={self.timeout_s:g}s"))

    def _abort(self, exc: redis.RedisError) -> None:
        self._fail_all(exc)
        self.transport.abort()

    def _fail_all(self, exc: redis.RedisError) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)


def _error(reply: hiredis.ReplyError) -> redis.RedisError:
    text = str(reply)
    if text.startswith("NOSCRIPT"):
        return redis.exceptions.NoScriptError(text)
    if text.startswith(("NOAUTH", "WRONGPASS")):
        return redis.AuthenticationError(text)
    if text.startswith("LOADING"):
        return redis.BusyLoadingError(text)
    return redis.ResponseError(text)


class LoopRedis:
    """One pipelined connection to the Redis at ``url``, used from one event loop."""

    def __init__(self, url: str, name: str | None = None, scripts: Iterable[LoopScript] = ()) -> None:
        self.url = url
        self.name = name  # the connection's name in CLIENT LIST
        # loaded on every new connection (a restarted Redis has none), so that the commands in
        # flight when the first one runs do not each find it missing
        self.scripts = tuple(scripts)
        self.sentinel = redis_url.parse_sentinel(url) if redis_url.is_sentinel(url) else None
        # (redis_url.endpoint: a ConfigError naming an option this client cannot honour)
        self.at = self.sentinel.primary if self.sentinel else redis_url.endpoint(url)
        self._ssl = self.at.tls_context()
        self._conn: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self.connections = 0  # opened so far (tests)

    async def call(self, *args: Any) -> Any:
        """Send one command and return its reply (bytes, ints, lists of them)."""
        conn = self._conn
        if conn is None or conn.lost or (self.at.health_check_s and not conn.waiting and self._stale(conn)):
            conn = await self._connect()
        return await conn.send(args)

    async def evalsha(self, script: LoopScript, keys: list[Any], args: list[Any]) -> Any:
        """Run ``script`` (loading it first if Redis no longer has it, e.g. after a restart)."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            await self.call("SCRIPT", "LOAD", script.source)
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)

    def _stale(self, conn: _Protocol) -> bool:
        """redis-py's health check: a connection idle past ``health_check_interval`` is replaced
        (a PING would cost the same round trip, and the deadline covers a dead one anyway)."""
        if asyncio.get_running_loop().time() - conn.last_io <= self.at.health_check_s:
            return False
        conn.transport.close()
        conn.lost = True
        return True

    async def _connect(self) -> _Protocol:
        # One connect, however many callers wait for it. It is forgotten once done, whoever
        # awaited it: a connect whose every waiter was cancelled must not be handed out later.
        if self._connecting is None or self._connecting.done():
            self._connecting = connecting = asyncio.ensure_future(self._open())
            connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, fut: asyncio.Future[_Protocol]) -> None:
        if self._connecting is fut:
            self._connecting = None
        if not fut.cancelled() and fut.exception() is not None:
            fut.exception()  # retrieved: a failed connect nobody awaited any longer is not logged

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        host, port = await self._primary() if self.sentinel else (self.at.host, self.at.port)
        where = self.at.path or f"{host}:{port}"
        factory = lambda: _Protocol(self.at.socket_timeout_s)  # noqa: E731
        try:
            async with asyncio.timeout(self.at.connect_timeout_s):
                if self.at.path:
                    _, conn = await loop.create_unix_connection(factory, self.at.path)
                else:
                    _, conn = await loop.create_connection(factory, host, port, ssl=self._ssl)
        except (OSError, TimeoutError) as exc:
            raise redis.ConnectionError(f"cannot connect to Redis at {where}: {exc or 'timed out'}") from exc
        if self.at.keepalive and not self.at.path:
            _keepalive(conn.transport)
        try:
            await self._hello(conn)
        except BaseException:
            conn.transport.abort()
            raise
        self._conn = conn
        self.connections += 1
        return conn

    async def _hello(self, conn: _Protocol) -> None:
        commands = self.at.hello(self.name)
        role_at = len(commands)
        if self.sentinel:  # a demoted primary the sentinels still named: not written to
            commands.append(("ROLE",))
        commands += [("SCRIPT", "LOAD", sc.source) for sc in self.scripts]
        hello = [conn.send(c) for c in commands]
        replies = [await reply for reply in hello]
        if self.sentinel:
            role = replies[role_at]
            if not role or role[0] != b"master":
                raise redis.ConnectionError(
                    f"the Redis the sentinels named as {self.sentinel.master_name!r} is not a master "
                    "(a failover is under way)"
                )

    async def _primary(self) -> tuple[str, int]:
        """Where the sentinels say the primary is (the first sentinel that answers)."""
        assert self.sentinel is not None
        s = self.sentinel
        loop = asyncio.get_running_loop()
        errors = []
        for host, port in s.hosts:
            try:
                async with asyncio.timeout(self.at.connect_timeout_s + (self.at.socket_timeout_s or 0)):
                    _, conn = await loop.create_connection(lambda: _Protocol(None), host, port)
                    try:
                        got = await conn.send(("SENTINEL", "GET-MASTER-ADDR-BY-NAME", s.master_name))
                    finally:
                        conn.transport.close()
            except (OSError, TimeoutError, redis.RedisError) as exc:
                errors.append(f"{host}:{port}: {exc or 'timed out'}")
                continue
            if got:
                return got[0].decode(), int(got[1])
            errors.append(f"{host}:{port}: knows no master named {s.master_name!r}")
        raise redis.ConnectionError(f"no sentinel named a primary: {'; '.join(errors)}")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.transport.close()
        self._conn = None


def _keepalive(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):  # Linux; macOS has TCP_KEEPALIVE instead of TCP_KEEPIDLE
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
