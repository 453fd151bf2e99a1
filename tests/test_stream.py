"""The worker's request path (``workers.stream``) where no server answers; what a server answers
is checked on both engines in test_sglang_conformance.py."""

from __future__ import annotations

import socket

import pytest
from openai import AsyncOpenAI

from tokenmill import errors
from workers.loop import run as run_on_worker_loop
from workers.stream import Progress, Route, stream_chat

REQUEST = {"model": "tm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_server_that_is_not_listening_is_a_connection_error_naming_it() -> None:
    async def go() -> None:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{closed_port()}/v1", api_key="k", max_retries=0)
        try:
            await stream_chat(client, REQUEST, {}, Progress())
        finally:
            await client.close()

    with pytest.raises(errors.ServerConnectionError) as refused:
        run_on_worker_loop(go())
    assert "connection to the server failed" in str(refused.value)
    assert isinstance(refused.value, errors.RetryableError)


def test_a_route_is_built_once_per_client_with_its_key_and_endpoint() -> None:
    client = AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="secret-key", max_retries=0)
    route = Route.of(client)
    assert Route.of(client) is route
    assert str(route.url) == "http://127.0.0.1:9/v1/chat/completions"
    assert route.headers["Authorization"] == "Bearer secret-key"
    assert route.transport is client._client._transport_for_url(route.url)
    assert route.ext["timeout"] == client._client.timeout.as_dict()
    other = AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="other", max_retries=0)
    assert Route.of(other).headers["Authorization"] == "Bearer other"
