"""Redis from an event loop: commands pipelined on one connection, replies parsed by hiredis.

The worker runs a job's ledger transitions on its event loop, beside the job's stream
(:mod:`workers.onloop`). Through redis-py's asyncio client a command cost that loop 95-118 µs of
CPU; here it costs 9-26 µs (one ``hiredis.pack_command``, a write, and a reply parsed in the
connection's ``data_received``; measured on this machine class, docs/benchmarks.md). Every
command of a process shares one connection: replies come back in the order the commands were
sent, so each caller's future is the next one waiting.

Only what the worker's transitions need: commands, ``EVALSHA`` with a load on ``NOSCRIPT``,
redis-py's URL forms (``redis://``, ``rediss://`` with its ``ssl_*`` options, ``unix://``),
``AUTH``, ``SELECT``, a client name, and scripts loaded on each new connection. Errors are
redis-py's own classes, so callers handle both clients alike: an error reply is a
``ResponseError`` (``NoScriptError`` for ``NOSCRIPT``), a lost or refused connection a
``ConnectionError``. A lost connection fails the commands in flight and the
next command opens a new one.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Iterable
from typing import Any

import hiredis
import redis
from redis.connection import SSLConnection, UnixDomainSocketConnection, parse_url

CONNECT_TIMEOUT_S = 5.0
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


class LoopScript:
    """A Lua script known by its SHA1, sent as ``EVALSHA`` and loaded when Redis lacks it."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            fut = self.waiting.popleft()
            if fut.done():  # its caller was cancelled; the reply is read all the same
                continue
            if isinstance(reply, hiredis.ReplyError):
                fut.set_exception(_error(reply))
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        why = f"the connection to Redis was lost{f': {exc}' if exc else ''}"
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(redis.ConnectionError(why))

    def send(self, packed: bytes) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        assert self.transport is not None
        self.transport.write(packed)
        return fut


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
        opts = parse_url(url)
        self.url = url
        self.name = name  # the connection's name in CLIENT LIST
        # loaded on every new connection (a restarted Redis has none), so that the commands in
        # flight when the first one runs do not each find it missing
        self.scripts = tuple(scripts)
        self._path: str | None = opts.get("path")
        self._host = opts.get("host") or "localhost"
        self._port = int(opts.get("port") or 6379)
        self._db = int(opts.get("db") or 0)
        self._user: str | None = opts.get("username")
        self._password: str | None = opts.get("password")
        cls = opts.get("connection_class")
        self._ssl = _ssl_context(opts) if cls is SSLConnection else None
        if cls not in (None, SSLConnection, UnixDomainSocketConnection):
            raise ValueError(f"unsupported Redis URL scheme for the loop's client: {url!r}")
        self._conn: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self.connections = 0  # opened so far (tests)

    async def call(self, *args: Any) -> Any:
        """Send one command and return its reply (bytes, ints, lists of them)."""
        conn = self._conn if self._conn is not None and not self._conn.lost else await self._connect()
        return await conn.send(hiredis.pack_command(args))

    async def evalsha(self, script: LoopScript, keys: list[Any], args: list[Any]) -> Any:
        """Run ``script`` (loading it first if Redis no longer has it, e.g. after a restart)."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            await self.call("SCRIPT", "LOAD", script.source)
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)

    async def _connect(self) -> _Protocol:
        if self._connecting is None:  # one connect, however many callers wait for it
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        where = self._path or f"{self._host}:{self._port}"
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                if self._path:
                    _, conn = await loop.create_unix_connection(_Protocol, self._path)
                else:
                    _, conn = await loop.create_connection(_Protocol, self._host, self._port, ssl=self._ssl)
        except (OSError, TimeoutError) as exc:
            raise redis.ConnectionError(f"cannot connect to Redis at {where}: {exc or 'timed out'}") from exc
        hello = []
        if self._password is not None:
            auth = ("AUTH", self._user, self._password) if self._user else ("AUTH", self._password)
            hello.append(conn.send(hiredis.pack_command(auth)))
        if self._db:
            hello.append(conn.send(hiredis.pack_command(("SELECT", self._db))))
        if self.name:
            hello.append(conn.send(hiredis.pack_command(("CLIENT", "SETNAME", self.name))))
        hello += [conn.send(hiredis.pack_command(("SCRIPT", "LOAD", sc.source))) for sc in self.scripts]
        try:
            for reply in hello:
                await reply
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise
        self._conn = conn
        self.connections += 1
        return conn

    def close(self) -> None:
        if self._conn is not None and self._conn.transport is not None:
            self._conn.transport.close()
        self._conn = None


def _ssl_context(opts: dict[str, Any]) -> ssl.SSLContext:
    """The TLS context redis-py would build for a ``rediss://`` URL's ``ssl_*`` options."""
    reqs = opts.get("ssl_cert_reqs", "required")
    verify = ssl.CERT_NONE if reqs is None else _CERT_REQS[reqs] if isinstance(reqs, str) else reqs
    ctx = ssl.create_default_context(cafile=opts.get("ssl_ca_certs"))
    ctx.check_hostname = bool(opts.get("ssl_check_hostname", True)) and verify != ssl.CERT_NONE
    ctx.verify_mode = verify
    if opts.get("ssl_certfile"):
        ctx.load_cert_chain(opts["ssl_certfile"], opts.get("ssl_keyfile"))
    return ctx
