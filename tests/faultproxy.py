"""A TCP proxy on loopback that can make the host behind it vanish, for the network-fault tests.

A host that vanishes (a failover, a NAT that forgot the connection, a pulled cable) does not
close anything: its open connections stop carrying bytes both ways and are never closed, and new
connections are accepted (here: a load balancer or NAT still answers the handshake) and never
answered. That is what :meth:`FaultProxy.vanish` does. :meth:`FaultProxy.replace` then brings a
replacement up at the same address: new connections are carried (to the same backend, or to
another: a promoted replica), the old ones stay silent forever.

The proxy runs its own asyncio loop on a daemon thread, so tests drive it from plain code.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from tokenmill.local_redis import free_port

CHUNK = 65536


@dataclass(eq=False)
class _Pair:
    """One client connection and, while carried, its connection to the backend."""

    client: asyncio.StreamWriter
    backend: asyncio.StreamWriter | None = None
    pipes: list[asyncio.Task[None]] = field(default_factory=list)


class FaultProxy:
    """``127.0.0.1:port`` forwarding to ``127.0.0.1:backend_port``, until told otherwise."""

    def __init__(self, backend_port: int, port: int | None = None) -> None:
        self.backend_port = backend_port
        self.port = port or free_port()
        self.carrying = True
        self.pairs: list[_Pair] = []  # every connection accepted, carried or not: none is closed
        self.accepted = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        return self

    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def vanish(self) -> None:
        """Open connections stop carrying bytes both ways, and are never closed; new connections
        are accepted and never answered."""

        async def freeze() -> None:
            self.carrying = False
            for pair in self.pairs:
                for task in pair.pipes:
                    task.cancel()

        self._call(freeze())

    def replace(self, backend_port: int | None = None) -> None:
        """A replacement at the same address: new connections are carried (to ``backend_port``
        if given); the connections of before stay silent."""

        async def resume() -> None:
            if backend_port is not None:
                self.backend_port = backend_port
            self.carrying = True

        self._call(resume())

    def close(self) -> None:
        """Close the listener and every connection (the test is over)."""

        async def shut() -> None:
            if self._server is not None:
                self._server.close()
            for pair in self.pairs:
                for task in pair.pipes:
                    task.cancel()
                for w in (pair.client, pair.backend):
                    if w is not None:
                        w.transport.abort()

        if self._thread.is_alive():
            self._call(shut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- on the proxy's loop --------------------------------------------------------------------

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        pair = _Pair(writer)
        self.pairs.append(pair)
        if not self.carrying:
            return  # accepted, held open, never answered
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend_port)
        except OSError:
            writer.transport.abort()  # the backend refused: so does the proxy
            return
        pair.backend = up_writer
        if not self.carrying:  # vanished while connecting
            return
        pair.pipes = [
            asyncio.ensure_future(_pipe(reader, up_writer)),
            asyncio.ensure_future(_pipe(up_reader, writer)),
        ]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Carry bytes one way; an end (EOF or error) is passed on as the real host would."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()
