"""HTTP/1.1 for the stream path: a response's body goes to a callback as its bytes arrive.

A connection is one ``asyncio.Protocol`` with an httptools (llhttp) parser. The body of a 2xx
answer is handed to the caller's callback from ``data_received``, so a streamed chunk costs a
parse and a call, and no task wakes up until the response is complete. Through the openai
client's aiohttp transport the same chunk went through aiohttp's protocol, a ``StreamReader``, a
task wake-up and three async iterators: 40 against 22 µs of CPU per token on the short-output
stream path (docs/benchmarks.md).

Connections are kept alive per server and reused. One idle longer than ``idle_s`` is closed
instead (uvicorn, SGLang's HTTP server, drops idle connections after 5 s), and a request whose
reused connection closes before any byte of an answer is sent again once on a new connection:
the server cannot have started it.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

IDLE_S = 4.0
BodySink = Callable[[bytes], None]


@dataclass(slots=True)
class Response:
    """A finished exchange: the status and headers, and the body unless a sink took it."""

    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)

    def header(self, name: bytes) -> bytes | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)


class _Exchange:
    """One request on a connection, as its answer is parsed."""

    __slots__ = ("decoder", "done", "response", "sink")

    def __init__(self, sink: BodySink, done: asyncio.Future[Response]) -> None:
        self.sink: BodySink | None = sink
        self.done = done
        self.response = Response()
        self.decoder: zlib._Decompress | None = None


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection, one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.lost = False
        self.reusable = False
        self.answered = False  # a byte of the latest request's answer arrived
        self.idle_since = 0.0

    # -- the caller's side ----------------------------------------------------------------------

    def send(self, data: bytes, sink: BodySink) -> asyncio.Future[Response]:
        """Write a request; the future resolves when its answer is complete."""
        assert self.transport is not None and self.exchange is None
        done = asyncio.get_running_loop().create_future()
        self.exchange = _Exchange(sink, done)
        self.reusable = self.answered = False
        self.transport.write(data)
        return done

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # nothing was asked: a server that talks out of turn is not reused
            self.close()
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # the sink raised: its error, as is
            self._fail(exc.__context__ or exc)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"the server's answer is not valid HTTP/1.1: {exc}"))

    def eof_received(self) -> None:
        self.lost = True  # the server is done with this connection; it closes (connection_lost)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        ex = self.exchange
        if ex is None:
            return
        r = ex.response
        if r.status and r.header(b"content-length") is None and r.header(b"transfer-encoding") is None:
            self.on_message_complete()  # a body delimited by the connection's end
            return
        reason = f" ({exc})" if exc else ""
        where = "mid-answer" if self.answered else "before answering"
        self._fail(ConnectionResetError(f"the server closed the connection {where}{reason}"))

    # -- httptools callbacks --------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.exchange is not None
        self.exchange.response.headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.exchange
        assert ex is not None
        r = ex.response
        r.status = self.parser.get_status_code()
        if not 200 <= r.status < 300:
            ex.sink = None  # an error's body is kept for the caller
        encoding = (r.header(b"content-encoding") or b"identity").strip().lower()
        if encoding in (b"gzip", b"deflate"):
            ex.decoder = zlib.decompressobj(zlib.MAX_WBITS | 32)  # either header, detected
        elif encoding != b"identity":
            raise ConnectionError(f"the server's answer has Content-Encoding {encoding.decode()!r}")

    def on_body(self, body: bytes) -> None:
        ex = self.exchange
        assert ex is not None
        if ex.decoder is not None:
            body = ex.decoder.decompress(body)
        if ex.sink is None:
            ex.response.body += body
        else:
            ex.sink(body)

    def on_message_complete(self) -> None:
        ex = self.exchange
        if ex is None:
            return
        self.exchange = None
        self.reusable = not self.lost and self.parser.should_keep_alive()
        if not ex.done.done():
            ex.done.set_result(ex.response)

    def _fail(self, exc: BaseException) -> None:
        ex, self.exchange = self.exchange, None
        self.close()
        if ex is not None and not ex.done.done():
            ex.done.set_exception(exc)


class ConnectionPool:
    """Kept-alive connections to one server (``scheme://host:port``), shared by its streams."""

    def __init__(self, url: str, connect_timeout_s: float, idle_s: float = IDLE_S) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            import httpx2  # the context the openai client would build: certifi, SSL_CERT_FILE

            self.ssl = httpx2.create_ssl_context()
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.idle: deque[Connection] = deque()  # the most recently used at the right
        self.opened = 0  # connections made, for tests and benchmarks

    async def request(self, data: bytes, sink: BodySink) -> Response:
        """Send ``data`` (a whole request) and wait for the answer; a 2xx body goes to ``sink``."""
        conn = self._reuse()
        if conn is not None:
            try:
                return await self._exchange(conn, data, sink)
            except ConnectionResetError:
                if conn.answered:
                    raise
        return await self._exchange(await self._connect(), data, sink)

    async def _exchange(self, conn: Connection, data: bytes, sink: BodySink) -> Response:
        done = conn.send(data, sink)
        try:
            response = await done
        except BaseException:
            conn.exchange = None
            conn.close()
            raise
        if conn.reusable and not conn.lost:
            conn.idle_since = now = time.monotonic()
            self.idle.append(conn)
            while self.idle[0].lost or now - self.idle[0].idle_since >= self.idle_s:
                self.idle.popleft().close()  # the least recently used, which no stream took again
        else:
            conn.close()
        return response

    def _reuse(self) -> Connection | None:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            closing = conn.transport is None or conn.transport.is_closing()
            if not conn.lost and not closing and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        return None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    Connection,
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except TimeoutError:
            raise TimeoutError(
                f"connecting to {self.host}:{self.port} took more than {self.connect_timeout_s:g}s"
            ) from None
        self.opened += 1
        return conn

    def close(self) -> None:
        """Close the idle connections (those in use close when their exchange ends)."""
        while self.idle:
            self.idle.pop().close()
