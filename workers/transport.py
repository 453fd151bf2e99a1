"""HTTP for the stream path: aiohttp, a response's body handed to a callback as its bytes arrive.

aiohttp keeps the promises a network client owes its users, with its own conformance suite:
``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` honoured (``trust_env``; HTTPS through ``CONNECT``),
``1xx`` interim answers skipped, redirects followed as the openai client (httpx) follows them
(307/308 send the request again, 301/302/303 turn a POST into a GET; ``Authorization`` is dropped
on a redirect to another origin), gzip and chunked bodies, TLS verified against the system's CAs
or ``SSL_CERT_FILE``/``SSL_CERT_DIR``.

tokenmill streamed on a hand-written HTTP/1.1 protocol before: on the stream path alone it cost
0.69x the CPU per token of aiohttp used directly, and aiohttp with the worker's own parser 0.97x
(bench/e2e.py --per-token, docs/benchmarks-history/end-to-end.md). Both are within 1.2x of aiohttp used
directly, so the one with fewer lines to own was kept.

Connections are kept alive per server and reused; one idle longer than ``idle_s`` is closed
(uvicorn, SGLang's HTTP server, drops idle connections after 5 s), and a request whose connection
closes before any byte of an answer is sent again once on a new connection: the server cannot
have started it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

IDLE_S = 4.0
BodySink = Callable[[bytes], None]


@dataclass(slots=True)
class Response:
    """A finished exchange: the status, and the body unless a sink took it."""

    status: int = 0
    body: bytes = b""


class HttpClient:
    """Kept-alive connections to the servers, shared by a process's streams (on its loop)."""

    def __init__(self, connect_timeout_s: float, answer_timeout_s: float | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        # a server sends a stream's headers at once (SGLang, as uvicorn, before the first token):
        # a request that none come back for in this long went to a host that vanished
        self.answer_timeout_s = answer_timeout_s
        self.idle_s = IDLE_S  # (tests shorten it)
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        """The session, made on first use (on the loop that will run it)."""
        if self._session is None or self._session.closed:
            # the system's CAs, or SSL_CERT_FILE / SSL_CERT_DIR as the process has them now
            tls = ssl.create_default_context()
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.idle_s, ssl=tls)
            # the stream's own deadlines (first token, stall, total) are the watch's
            timeout = aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, trust_env=True, auto_decompress=True
            )
        return self._session

    async def post(
        self, url: str, body: bytes, headers: dict[str, str], sink: BodySink, *, unstreamed: bool = False
    ) -> Response:
        """POST ``body`` and wait for the whole answer; a 2xx body goes to ``sink`` as it arrives,
        any other is kept in the response. A failure is an ``OSError`` (``TimeoutError`` for the
        connect) whose message says what happened. An ``unstreamed`` request's answer comes only
        once it is whole: no answer deadline then (the caller's total one holds)."""
        try:
            try:
                return await self._post(url, body, headers, sink, unstreamed)
            except aiohttp.ServerDisconnectedError as exc:
                if getattr(exc, "tokenmill_answered", False):
                    raise
            return await self._post(url, body, headers, sink, unstreamed)
        except aiohttp.ClientError as exc:
            raise _oserror(exc, url, self.connect_timeout_s) from exc

    async def _post(
        self, url: str, body: bytes, headers: dict[str, str], sink: BodySink, unstreamed: bool
    ) -> Response:
        try:
            async with asyncio.timeout(None if unstreamed else self.answer_timeout_s):
                resp = await self.session().post(url, data=body, headers=headers)
        except TimeoutError as exc:
            if isinstance(exc, aiohttp.ClientError):  # the connect's own deadline
                raise
            raise TimeoutError(
                f"{_where(url)} sent no answer within {self.answer_timeout_s:g}s of the request"
            ) from None
        async with resp:
            try:
                if not 200 <= resp.status < 300:
                    return Response(resp.status, await resp.read())
                async for chunk in resp.content.iter_any():
                    sink(chunk)
            except aiohttp.ClientError as exc:
                exc.tokenmill_answered = True  # type: ignore[attr-defined]  # not sent again
                raise
            return Response(resp.status)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _oserror(exc: aiohttp.ClientError, url: str, connect_timeout_s: float) -> OSError:
    """aiohttp's error as the ``OSError`` the error taxonomy reads, in words."""
    where = _where(url)
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return TimeoutError(f"connecting to {where} took more than {connect_timeout_s:g}s")
    if isinstance(exc, aiohttp.ClientHttpProxyError):
        return ConnectionError(
            f"the HTTP proxy refused to carry the request to {where}: {exc.status} {exc.message}"
        )
    if isinstance(exc, aiohttp.TooManyRedirects):
        return ConnectionError(f"{where} redirected too many times ({len(exc.history)})")
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        when = "mid-answer" if getattr(exc, "tokenmill_answered", False) else "before answering"
        return ConnectionResetError(f"the server closed the connection {when} ({exc})")
    if isinstance(exc, aiohttp.ClientResponseError):
        return ConnectionError(f"the server's answer is not valid HTTP/1.1: {exc.message}")
    if isinstance(exc, OSError):
        return exc
    return ConnectionError(f"{type(exc).__name__} talking to {where}: {exc}")


def _where(url: str) -> str:
    return urlsplit(url).netloc.rpartition("@")[2]
