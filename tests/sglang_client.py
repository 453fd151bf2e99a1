"""Speaking to an engine in the conformance tests: raw SSE frames, plain JSON, and tokenmill's own
streaming client (``workers.stream.stream_chat``), so a test checks what tokenmill relies on."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from tests.engines import Engine
from workers.event_loop import run as run_on_worker_loop
from workers.stream import STREAM_OPTIONS, Progress, StreamClient, stream_chat


def post_json(
    engine: Engine, path: str, body: dict[str, Any], auth: bool = True, timeout: float = 120.0
) -> tuple[int, Any]:
    """POST ``body`` (with the engine's API key unless ``auth`` is False); (status, JSON body)."""
    headers = {"Content-Type": "application/json", **(engine.headers() if auth else {})}
    request = urllib.request.Request(engine.url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def get_json(engine: Engine, path: str, auth: bool = True, timeout: float = 30.0) -> tuple[int, Any]:
    request = urllib.request.Request(engine.url + path, headers=engine.headers() if auth else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if body else None
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if body else None


def sse_frames(engine: Engine, body: dict[str, Any], timeout: float = 120.0) -> list[Any]:
    """Stream a chat request and return every ``data:`` frame (JSON, or the string ``[DONE]``)."""
    parts = urlsplit(engine.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json", **engine.headers()},
        )
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read())
        frames: list[Any] = []
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                frames.append(payload if payload == "[DONE]" else json.loads(payload))
        return frames
    finally:
        conn.close()


def chat(engine: Engine, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
    """A non-streamed chat completion; asserts it succeeded."""
    status, body = post_json(engine, "/v1/chat/completions", {"model": "tm", "messages": messages, **params})
    assert status == 200, body
    return body


def client(engine: Engine, api_key: str | None = None) -> StreamClient:
    """tokenmill's stream client for ``engine``, as a worker builds it."""
    return StreamClient(engine.url, api_key or engine.api_key, connect_timeout_s=10.0)


def stream(
    engine: Engine, request: dict[str, Any], extra: dict[str, Any] | None = None, api_key: str | None = None
) -> Progress:
    """Stream ``request`` through tokenmill's client; raises the classified error on failure."""

    async def go() -> Progress:
        c = client(engine, api_key)
        try:
            return await stream_chat(c, request, extra or {}, Progress())
        finally:
            await c.close()

    return run_on_worker_loop(go())


def stream_options() -> dict[str, Any]:
    return {"stream_options": STREAM_OPTIONS}
