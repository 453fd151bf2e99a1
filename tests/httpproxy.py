"""A small HTTP forward proxy on loopback, as a user's network puts one in front of a server.

It takes ``CONNECT host:port`` (a tunnel, for ``https://`` through ``HTTPS_PROXY``) and
absolute-form requests (``POST http://host:port/path HTTP/1.1``, for ``http://`` through
``HTTP_PROXY``), forwarding the latter in origin form. Every request it carried is recorded
(method and target), so a test can tell what went through it. It runs its own asyncio loop on a
daemon thread; a request to anything but loopback is refused (this proxy never leaves the host).
"""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlsplit

from tokenmill.local_redis import free_port

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ForwardProxy:
    """``http://127.0.0.1:port``: a forward proxy; ``carried`` lists ``"METHOD target"``."""

    def __init__(self) -> None:
        self.port = free_port()
        self.carried: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ForwardProxy:
        self._thread.start()
        start = asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        async def shut() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # one request after another on a kept-alive connection to the proxy
                head = await reader.readuntil(b"\r\n\r\n")
                method, target, version = head.split(b"\r\n", 1)[0].decode().split(" ")
                self.carried.append(f"{method} {target}")
                if method == "CONNECT":
                    host, _, port = target.rpartition(":")
                    await self._tunnel(reader, writer, host, int(port))
                    return
                if not await self._forward(reader, writer, head, method, target, version):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _tunnel(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int
    ) -> None:
        if host.strip("[]") not in LOOPBACK:
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return
        up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), port)
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def _forward(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, method: str,
        target: str, version: str,
    ) -> bool:  # fmt: skip
        """Forward one absolute-form request and its whole answer; whether the client's
        connection may carry another."""
        parts = urlsplit(target)
        if parts.hostname not in LOOPBACK:
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            return False
        lines = head.split(b"\r\n")[1:]
        length = next(
            (int(v) for k, _, v in (x.partition(b":") for x in lines) if k.lower() == b"content-length"), 0
        )
        body = await reader.readexactly(length) if length else b""
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        up_reader, up_writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        kept = [x for x in lines if x and not x.lower().startswith((b"proxy-", b"connection:"))]
        up_writer.write(
            f"{method} {path} {version}\r\n".encode()
            + b"\r\n".join([*kept, b"Connection: close"])
            + b"\r\n\r\n"
            + body
        )
        await up_writer.drain()
        # the answer, as it streams, until the server closes (Connection: close); then this
        # connection closes too (the client opens another)
        await _pipe(up_reader, writer)
        return False


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()
