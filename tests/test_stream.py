"""The worker's request path (``workers.stream`` on ``workers.transport``) where no server
answers, or answers oddly; what a real server answers is checked on both engines in
test_sglang_conformance.py."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import pytest

from tests.certs import self_signed
from tokenmill import errors
from workers.loop import run as run_on_worker_loop
from workers.stream import Progress, StreamClient, stream_chat

REQUEST = {"model": "tm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    """A raw TCP server on a free loopback port running ``handler`` per connection."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def sse(*events: bytes) -> bytes:
    """A chunked SSE body: one HTTP chunk per event, then the last chunk."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + body
        + b"0\r\n\r\n"
    )


def delta(text: str, n: int) -> bytes:
    chunk = {
        "model": "tm",
        "choices": [{"delta": {"content": text}, "finish_reason": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": n},
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


FINISH = b'data: {"model":"tm","choices":[{"delta":{},"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'


def test_a_server_that_is_not_listening_is_a_connection_error_naming_it() -> None:
    async def go() -> None:
        client = StreamClient.of(f"http://127.0.0.1:{closed_port()}", "k", 5.0)
        try:
            await stream_chat(client, REQUEST, {}, Progress())
        finally:
            await client.close()

    with pytest.raises(errors.ServerConnectionError) as refused:
        run_on_worker_loop(go())
    assert "connection to the server failed" in str(refused.value)
    assert isinstance(refused.value, errors.RetryableError)


def test_the_request_carries_the_key_and_endpoint_and_a_chunk_split_anywhere_is_read_whole() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        answer = sse(delta("Hel", 1), delta("lo ✓", 2), FINISH)
        for i in range(0, len(answer), 7):  # the answer arrives 7 bytes at a time
            writer.write(answer[i : i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        writer.close()

    async def go() -> Progress:
        server, url = await serve(handler)
        client = StreamClient.of(url, "secret-key", 5.0)
        try:
            return await stream_chat(client, REQUEST, {"rid": "r/j/1"}, Progress())
        finally:
            await client.close()
            server.close()

    progress = run_on_worker_loop(go())

    assert "".join(progress.content) == "Hello ✓" and progress.tokens == 2
    assert progress.finish_reason == "length"
    head, body = seen[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer secret-key" in head and b"\r\nAccept-Encoding: identity" in head
    assert b'"rid":"r/j/1"' in body and b'"stream":true' in body


def test_connections_are_kept_alive_and_one_the_server_closed_while_idle_is_replaced() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for _ in range(2):  # two requests per connection, then the server closes it
            await read_request(reader)
            writer.write(sse(delta("x", 1), FINISH))
            await writer.drain()
        writer.close()

    async def go() -> list[int]:
        server, url = await serve(handler)
        client = StreamClient.of(url, None, 5.0)
        try:
            tokens = []
            for _ in range(5):
                tokens.append((await stream_chat(client, REQUEST, {}, Progress())).tokens)
                await asyncio.sleep(0.05)  # the close reaches the client while it is idle
            return tokens
        finally:
            await client.close()
            server.close()

    assert run_on_worker_loop(go()) == [1] * 5
    assert connections == 3


def test_connections_no_stream_takes_again_are_closed_once_idle_too_long() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                writer.write(sse(delta("x", 1), FINISH))
                await writer.drain()
        except asyncio.IncompleteReadError:
            writer.close()

    async def go() -> tuple[int, int]:
        server, url = await serve(handler)
        client = StreamClient.of(url, None, 5.0)
        client.pool.idle_s = 0.3
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(stream_chat(client, REQUEST, {}, Progress()) for _ in range(3)))
            since = loop.time()
            while loop.time() - since < 0.5:  # one stream at a time: it takes the same connection
                await stream_chat(client, REQUEST, {}, Progress())
                await asyncio.sleep(0.05)
            return client.pool.opened, len(client.pool.idle)
        finally:
            await client.close()
            server.close()

    assert run_on_worker_loop(go()) == (3, 1)


def test_a_reused_connection_closed_before_answering_is_retried_once_on_a_new_one() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(sse(delta("x", 1), FINISH))
        await writer.drain()
        if connections == 1:
            await read_request(reader)  # the second request: closed unanswered
        writer.close()

    async def go() -> list[int]:
        server, url = await serve(handler)
        client = StreamClient.of(url, None, 5.0)
        try:
            return [(await stream_chat(client, REQUEST, {}, Progress())).tokens for _ in range(2)]
        finally:
            await client.close()
            server.close()

    assert run_on_worker_loop(go()) == [1, 1]
    assert connections == 2


def test_a_server_that_closes_mid_stream_is_a_retryable_connection_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sse(delta("x", 1), FINISH)[:-40])
        await writer.drain()
        writer.close()

    async def go() -> None:
        server, url = await serve(handler)
        client = StreamClient.of(url, None, 5.0)
        try:
            await stream_chat(client, REQUEST, {}, Progress())
        finally:
            await client.close()
            server.close()

    with pytest.raises(errors.ServerConnectionError) as cut:
        run_on_worker_loop(go())
    assert "closed the connection mid-answer" in cut.value.message


def test_an_error_status_keeps_the_servers_message_and_an_invalid_answer_names_itself() -> None:
    error = b'{"object":"error","message":"top_p must be in (0, 1], got 1.5.","code":400}'
    answers = [
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
        % (len(error), error),
        b"SMTP ready\r\n\r\n",
    ]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answers.pop(0))
        await writer.drain()
        writer.close()

    async def go() -> list[errors.GenerationError]:
        server, url = await serve(handler)
        client = StreamClient.of(url, None, 5.0)
        out = []
        try:
            for _ in range(2):
                try:
                    await stream_chat(client, REQUEST, {}, Progress())
                except errors.GenerationError as exc:
                    out.append(exc)
        finally:
            await client.close()
            server.close()
        return out

    invalid, garbage = run_on_worker_loop(go())
    assert isinstance(invalid, errors.InvalidRequestError) and invalid.status == 400
    assert invalid.message == "top_p must be in (0, 1], got 1.5."
    assert isinstance(garbage, errors.ServerConnectionError)
    assert "not valid HTTP/1.1" in garbage.message


def test_a_connect_that_hangs_times_out_after_connect_timeout_s() -> None:
    # A listening socket that never accepts, its backlog full: the kernel drops further SYNs
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)

        async def go() -> None:
            client = StreamClient.of(f"http://127.0.0.1:{port}", None, 0.3)
            try:
                await stream_chat(client, REQUEST, {}, Progress())
            finally:
                await client.close()

        try:
            with pytest.raises(errors.RequestTimeoutError) as slow:
                run_on_worker_loop(go())
        finally:
            for s in fillers:
                s.close()
    assert f"connecting to 127.0.0.1:{port} took more than 0.3s" in slow.value.message


def test_an_https_server_is_streamed_over_tls_verified_against_ssl_cert_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key, ca = self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sse(delta("over tls", 1), FINISH))
        await writer.drain()
        writer.close()

    async def go(verify_with: Path) -> Progress:
        monkeypatch.setenv("SSL_CERT_FILE", str(verify_with))
        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_ctx)
        client = StreamClient.of(f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}", None, 5.0)
        try:
            return await stream_chat(client, REQUEST, {}, Progress())
        finally:
            await client.close()
            server.close()

    assert "".join(run_on_worker_loop(go(ca)).content) == "over tls"
    _, _, other_ca = self_signed(tmp_path / "other")
    with pytest.raises(errors.ServerConnectionError) as refused:
        run_on_worker_loop(go(other_ca))
    assert "certificate verify failed" in refused.value.message
