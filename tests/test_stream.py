"""The worker's request path (``workers.stream`` on ``workers.transport``) where no server
answers, or answers oddly, and through what users' networks put in the way: an HTTP(S) proxy
(``tests.httpproxy``, a real forward proxy on loopback), interim ``1xx`` answers, redirects. What
a real server answers is checked on both engines in test_sglang_conformance.py."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import pytest

from tests.certs import self_signed
from tests.httpproxy import ForwardProxy
from tokenmill import errors
from workers.event_loop import run as run_on_worker_loop
from workers.stream import Progress, StreamClient, stream_chat, whole_chat

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
        client = StreamClient(f"http://127.0.0.1:{closed_port()}", "k", 5.0)
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
        client = StreamClient(url, "secret-key", 5.0)
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
        client = StreamClient(url, None, 5.0)
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


def test_connections_idle_past_idle_s_are_closed_by_the_client_and_the_next_stream_opens_one() -> None:
    opened = closed = 0
    burst_in = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened, closed
        opened += 1
        if opened == 3:
            burst_in.set()
        try:
            while True:
                await read_request(reader)
                # no answer before the burst's three streams are all in: on a loaded machine the
                # first could otherwise end before the others connect, and they would reuse it
                await asyncio.wait_for(burst_in.wait(), 10)
                writer.write(sse(delta("x", 1), FINISH))
                await writer.drain()
        except asyncio.IncompleteReadError:  # the client closed it
            closed += 1
            writer.close()

    async def go() -> tuple[int, int, int]:
        server, url = await serve(handler)
        client = StreamClient(url, None, 5.0)
        client.http.idle_s = 0.3
        loop = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(stream_chat(client, REQUEST, {}, Progress()) for _ in range(3)))
            burst, since = opened, loop.time()
            # nothing more to stream: wait for the closes, less long than the default idle_s (4 s)
            while closed < burst and loop.time() - since < 3:
                await asyncio.sleep(0.02)
            closed_idle = closed
            await stream_chat(client, REQUEST, {}, Progress())
            return burst, closed_idle, opened
        finally:
            await client.close()
            server.close()

    burst, closed_idle, opened_after = run_on_worker_loop(go())
    # the burst's three connections are closed by the client once idle past idle_s (before a
    # server's own keep-alive would close one under a request), and the next stream opens one
    assert (burst, closed_idle, opened_after) == (3, 3, 4)


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
        client = StreamClient(url, None, 5.0)
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
        client = StreamClient(url, None, 5.0)
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
        client = StreamClient(url, None, 5.0)
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
            client = StreamClient(f"http://127.0.0.1:{port}", None, 0.3)
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


def test_a_request_no_answer_comes_back_for_fails_after_answer_timeout_s() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)  # a host that vanished: the request was taken, nothing comes back

    async def go() -> float:
        server, url = await serve(handler)
        client = StreamClient(url, None, 5.0, answer_timeout_s=0.5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:  # (waited for 10 s at most: an upper bound of a few times 0.5 s a loaded machine misses)
            await asyncio.wait_for(stream_chat(client, REQUEST, {}, Progress()), 10)
        except errors.RequestTimeoutError as exc:
            assert "sent no answer within 0.5s" in exc.message
            return loop.time() - started
        except TimeoutError:
            raise AssertionError("the request had not timed out by itself after 10 s") from None
        finally:
            await client.close()
            server.close()
        raise AssertionError("the request did not time out")

    assert run_on_worker_loop(go()) > 0.4


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
        client = StreamClient(f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}", None, 5.0)
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


# --- what users' networks need: proxies, interim answers, redirects ------------------------------


def test_streams_go_through_http_proxy_and_no_proxy_bypasses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sse(delta("via", 1), FINISH))
        await writer.drain()
        writer.close()

    async def go() -> str:
        server, url = await serve(handler)
        client = StreamClient(url, "k", 5.0)
        try:
            return "".join((await stream_chat(client, REQUEST, {}, Progress())).content)
        finally:
            await client.close()
            server.close()

    with ForwardProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert run_on_worker_loop(go()) == "via"
        through = list(proxy.carried)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert run_on_worker_loop(go()) == "via"
    assert len(through) == 1 and through[0].startswith("POST http://127.0.0.1:")
    assert through[0].endswith("/v1/chat/completions")
    assert proxy.carried == through  # NO_PROXY: the second stream went straight to the server


def test_an_https_stream_is_tunnelled_through_https_proxy_and_still_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key, ca = self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sse(delta("tunnelled", 1), FINISH))
        await writer.drain()
        writer.close()

    async def go() -> tuple[str, int]:
        server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        client = StreamClient(f"https://127.0.0.1:{port}", None, 5.0)
        try:
            return "".join((await stream_chat(client, REQUEST, {}, Progress())).content), port
        finally:
            await client.close()
            server.close()

    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with ForwardProxy() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        text, port = run_on_worker_loop(go())
    assert text == "tunnelled"
    assert proxy.carried == [f"CONNECT 127.0.0.1:{port}"]


def test_interim_1xx_answers_are_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n")
        await writer.drain()
        writer.write(sse(delta("after the hints", 1), FINISH))
        await writer.drain()
        writer.close()

    progress = _stream_from(handler)
    assert "".join(progress.content) == "after the hints" and progress.finish_reason == "length"


def test_redirects_are_followed_as_the_openai_client_follows_them() -> None:
    seen: list[bytes] = []

    async def other(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(sse(delta("moved", 1), FINISH))
        await writer.drain()
        writer.close()

    async def go() -> tuple[list[str], list[bytes]]:
        target, target_url = await serve(other)

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await read_request(reader)
            seen.append(head)
            if b" /v1/chat/completions " in head:  # 307: the same request again, elsewhere here
                writer.write(
                    b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /v2/chat\r\nContent-Length: 0\r\n\r\n"
                )
            else:  # 308 to another origin: the key is not sent there
                loc = f"{target_url}/v3/chat".encode()
                writer.write(
                    b"HTTP/1.1 308 Permanent Redirect\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n" % loc
                )
            await writer.drain()
            writer.close()

        server, url = await serve(handler)
        client = StreamClient(url, "secret-key", 5.0)
        try:
            texts = ["".join((await stream_chat(client, REQUEST, {"rid": "r/j/1"}, Progress())).content)]
            return texts, seen
        finally:
            await client.close()
            server.close()
            target.close()

    texts, requests = run_on_worker_loop(go())
    assert texts == ["moved"]
    first, second, third = (r.split(b"\r\n\r\n", 1) for r in requests)
    assert first[0].startswith(b"POST /v1/chat/completions ") and second[0].startswith(b"POST /v2/chat ")
    assert third[0].startswith(b"POST /v3/chat ")
    assert first[1] == second[1] == third[1] and b'"rid":"r/j/1"' in third[1]  # the body, each time
    assert b"Bearer secret-key" in second[0] and b"secret-key" not in third[0]


def _answer_once(events: tuple[bytes, ...]) -> Progress:
    """Stream ``REQUEST`` from a server that answers with ``events`` (raw SSE) and closes."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(sse(*events))
        await writer.drain()
        writer.close()

    return _stream_from(handler)


def _stream_from(handler: Handler) -> Progress:
    """Stream ``REQUEST`` on a fresh client from a loopback server run by ``handler``."""

    async def go() -> Progress:
        server, url = await serve(handler)
        client = StreamClient(url, None, 5.0)
        try:
            return await stream_chat(client, REQUEST, {}, Progress())
        finally:
            await client.close()
            server.close()

    return run_on_worker_loop(go())


def test_a_stream_the_server_ends_with_finish_reason_abort_is_a_retryable_stream_error() -> None:
    # Given a server whose stream ends with finish_reason "abort" (SGLang's aborted request)
    abort = b'data: {"model":"tm","choices":[{"delta":{},"finish_reason":"abort"}]}\n\ndata: [DONE]\n\n'

    # When a worker streams from it
    with pytest.raises(errors.StreamError) as aborted:
        _answer_once((delta("half an ans", 1), abort))

    # Then the stream is not taken as an answer: it is a stream error, to be retried
    assert aborted.value.message == "the server aborted the request (finish_reason: abort)"
    assert isinstance(aborted.value, errors.RetryableError)


def test_an_answer_sent_whole_that_the_server_aborted_is_a_retryable_stream_error() -> None:
    # Given a server that answers a request sent whole (logprobs) with finish_reason "abort"
    answer = orjson.dumps(
        {
            "model": "tm",
            "choices": [{"message": {"role": "assistant", "content": "half"}, "finish_reason": "abort"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        writer.write(head % len(answer) + answer)
        await writer.drain()
        writer.close()

    async def go() -> Progress:
        server, url = await serve(handler)
        client = StreamClient(url, None, 5.0)
        try:
            return await whole_chat(client, {**REQUEST, "logprobs": True}, {}, Progress())
        finally:
            await client.close()
            server.close()

    # When a worker sends the request to it
    with pytest.raises(errors.StreamError) as aborted:
        run_on_worker_loop(go())

    # Then the answer is not taken as a whole one: it is a stream error, to be retried
    assert aborted.value.message == "the server aborted the request (finish_reason: abort)"
    assert isinstance(aborted.value, errors.RetryableError)


def test_a_stream_that_ends_without_a_finish_reason_is_a_retryable_stream_error() -> None:
    # Given a server whose stream is well formed to [DONE] but never states a finish_reason
    # When a worker streams from it
    with pytest.raises(errors.StreamError) as unfinished:
        _answer_once((delta("some", 1), delta(" text", 2), b"data: [DONE]\n\n"))

    # Then the text is not taken as a whole answer
    assert unfinished.value.message == "the stream ended without a finish_reason"
    assert isinstance(unfinished.value, errors.RetryableError)


def test_a_reused_connection_closed_mid_answer_is_not_sent_again_and_the_error_says_so() -> None:
    requests = connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests, connections
        connections += 1
        # Given a server whose first connection answers one request whole, then, kept alive,
        # starts the second request's answer and closes in the middle of it
        await read_request(reader)
        requests += 1
        writer.write(sse(delta("x", 1), FINISH))
        await writer.drain()
        if connections == 1:
            await read_request(reader)
            requests += 1
            writer.write(sse(delta("half", 1), FINISH)[:-40])
            await writer.drain()
        writer.close()

    async def go() -> tuple[int, BaseException]:
        server, url = await serve(handler)
        client = StreamClient(url, None, 5.0)
        try:
            first = (await stream_chat(client, REQUEST, {}, Progress())).tokens
            second = await asyncio.gather(
                stream_chat(client, REQUEST, {}, Progress()), return_exceptions=True
            )
            return first, second[0]
        finally:
            await client.close()
            server.close()

    # When a worker streams twice in a row on the one connection
    first, second = run_on_worker_loop(go())

    # Then the second request, half answered, was sent once only, and it failed saying where
    assert first == 1
    assert (requests, connections) == (2, 1), "the half-answered request was sent again"
    assert isinstance(second, errors.ServerConnectionError), repr(second)
    assert "closed the connection mid-answer" in second.message
