"""A small synchronous Redis client for the commands that only read (``status``, ``runs``).

Scripts and watch loops call ``tokenmill status`` often, and importing redis-py costs a process
~0.3 s of CPU, most of such a call (``bench/startup.py``, docs/benchmarks-history/startup.md). These commands
read a few hashes and sets, so they talk to Redis through this client instead: hiredis parses
the replies (a C extension, imported in milliseconds) and nothing of redis-py is imported.

It keeps the promises redis-py keeps for these commands: the same URL forms (``redis://`` with a
user, a password and a database; ``rediss://`` with the ``ssl_*`` options, verifying the server's
certificate by default; ``unix://``), ``AUTH``, ``SELECT``, a client name, a connect timeout and
a read timeout; each read command's reply in redis-py's shape (``hgetall`` a dict, ``smembers``
a set, ``sismember`` a bool, ``time`` a tuple), so the same read functions take either client;
pipelines (``pipeline(transaction=False)``) sent in one write. A connection lost between two
commands is opened again once (every command here is a read, safe to repeat). Every failure
is a :class:`~tokenmill.errors.RedisUnavailableError` naming the redacted URL. A Sentinel URL
is left to redis-py: :func:`connect` returns a redis-py client for it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import hiredis

from tokenmill import redis_url
from tokenmill.errors import PUT_PASSWORD, RedisUnavailableError, failure, refused, unreachable
from tokenmill.replies import pairs

if TYPE_CHECKING:
    import redis

    from tokenmill.settings import Settings

Convert = Callable[[Any], Any] | None


def connect(settings: Settings, *, name: str | None = None) -> QuickRedis | redis.Redis:
    """A read client for ``settings.redis_url``, connected and checked: this module's client, or
    redis-py's (checked by :func:`tokenmill.redis_conn.connect`) for a URL it does not handle."""
    quick = QuickRedis.from_url(settings.redis_url, name=name)
    if quick is not None:
        quick.ping()
        return quick
    from tokenmill import redis_conn

    return redis_conn.connect(settings, name=name)


def _read(command: str, convert: Convert = None) -> Callable[..., Any]:
    """A read command as a method of :class:`_Reads` (its arguments are the command's)."""
    return lambda self, *args: self._run(convert, command, *args)


class _Reads:
    """The read commands, in redis-py's reply shapes; ``_run`` runs one or queues it."""

    def _run(self, convert: Convert, *args: Any) -> Any:
        raise NotImplementedError

    def hmget(self, key: str, fields: list[str]) -> Any:
        return self._run(None, "HMGET", key, *fields)

    ping = _read("PING", lambda reply: reply == b"PONG")
    get = _read("GET")
    hget = _read("HGET")
    hgetall = _read("HGETALL", lambda reply: dict(pairs(reply)))
    smembers = _read("SMEMBERS", set)
    sismember = _read("SISMEMBER", bool)
    scard = _read("SCARD")
    zcard = _read("ZCARD")
    llen = _read("LLEN")
    time = _read("TIME", lambda reply: (int(reply[0]), int(reply[1])))


class QuickRedis(_Reads):
    """One connection to the Redis at ``url``, opened at the first command."""

    def __init__(self, url: str, at: redis_url.Endpoint, name: str | None = None) -> None:
        self.url = url
        self._address = at.path or (at.host, at.port)
        self._at = at  # deadlines from the URL, else redis-py's (5 s)
        self._tls = at.tls_context()
        self._hello = at.hello(name)  # AUTH, SELECT, CLIENT SETNAME: sent first on every connection
        self._sock: socket.socket | None = None
        self._reader = hiredis.Reader()

    @classmethod
    def from_url(cls, url: str, name: str | None = None) -> QuickRedis | None:
        """The client for ``url``; None for a Sentinel URL (redis-py's client finds the primary)."""
        if redis_url.is_sentinel(url):
            return None
        return cls(url, redis_url.endpoint(url), name)

    def pipeline(self, transaction: bool = False) -> Pipeline:
        """Commands queued and sent in one write by :meth:`Pipeline.execute` (never MULTI)."""
        if transaction:
            raise ValueError("QuickRedis reads only: no transactions")
        return Pipeline(self)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _run(self, convert: Convert, *args: Any) -> Any:
        (reply,) = self.send([(convert, args)])
        return reply

    def send(self, commands: list[tuple[Convert, tuple[Any, ...]]]) -> list[Any]:
        """Each command's reply (converted), in order."""
        packed = b"".join(hiredis.pack_command(args) for _, args in commands)
        reused = self._sock is not None
        try:
            replies = self._exchange(packed, len(commands))
        except TimeoutError:
            raise unreachable(self.url, f"no answer within {self._at.socket_timeout_s:g} s") from None
        except OSError as exc:  # ConnectionError included
            if not reused:
                raise unreachable(self.url, f"it closed the connection: {exc}") from None
            # Redis closed the connection since our last command (a restart, its idle timeout):
            # every command here is a read, so send them once more on a new connection.
            try:
                replies = self._exchange(packed, len(commands))
            except OSError as again:
                raise unreachable(self.url, f"it closed the connection: {again}") from None
        out = []
        for (convert, args), reply in zip(commands, replies, strict=True):
            if isinstance(reply, hiredis.ReplyError):
                raise self._error_reply(str(args[0]), str(reply))
            out.append(reply if convert is None else convert(reply))
        return out

    def _exchange(self, packed: bytes, n: int) -> list[Any]:
        sock = self._sock or self._open()
        try:
            sock.sendall(packed)
            return self._read(sock, n)
        except BaseException:
            self.close()
            raise

    def _read(self, sock: socket.socket, n: int) -> list[Any]:
        replies: list[Any] = []
        while len(replies) < n:
            reply = self._reader.gets()
            if reply is not False:
                replies.append(reply)
                continue
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("Redis closed the connection")
            self._reader.feed(data)
        return replies

    def _open(self) -> socket.socket:
        self._reader = hiredis.Reader()
        try:
            sock = self._connect()
        except OSError as exc:
            raise unreachable(self.url, str(exc) or "timed out") from None
        if self._hello:
            try:
                sock.sendall(b"".join(hiredis.pack_command(c) for c in self._hello))
                replies = self._read(sock, len(self._hello))
            except OSError as exc:
                sock.close()
                raise unreachable(self.url, f"the connection failed while it was opened: {exc}") from None
            for command, reply in zip(self._hello, replies, strict=True):
                if isinstance(reply, hiredis.ReplyError):
                    sock.close()
                    raise self._error_reply(str(command[0]), str(reply))
        self._sock = sock
        return sock

    def _connect(self) -> socket.socket:
        if isinstance(self._address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._at.connect_timeout_s)
            try:
                sock.connect(self._address)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(self._address, timeout=self._at.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                try:
                    sock = self._tls.wrap_socket(sock, server_hostname=self._address[0])
                except BaseException:
                    sock.close()
                    raise
        sock.settimeout(self._at.socket_timeout_s)
        return sock

    def _error_reply(self, command: str, text: str) -> RedisUnavailableError:
        if text.startswith("NOAUTH"):
            return failure(self.url, f"needs a password: {text} {PUT_PASSWORD}")
        if command == "AUTH" or text.startswith("WRONGPASS"):
            return refused(text, self.url)
        return failure(self.url, f"answered {command} with an error: {text}")


if TYPE_CHECKING:
    ReadClient = redis.Redis | QuickRedis  # what the read functions of status and runs take


class Pipeline(_Reads):
    """Read commands queued on a :class:`QuickRedis`, sent together by :meth:`execute`."""

    def __init__(self, client: QuickRedis) -> None:
        self._client = client
        self._queued: list[tuple[Convert, tuple[Any, ...]]] = []

    def _run(self, convert: Convert, *args: Any) -> Pipeline:
        self._queued.append((convert, args))
        return self

    def execute(self) -> list[Any]:
        queued, self._queued = self._queued, []
        return self._client.send(queued) if queued else []
