"""The sim engine behaves as SGLang 0.5.23 does, and its output is exactly predictable.

Each sim runs as a real subprocess (``python -m server_mgr.sim``) on a free port, spoken to with
a plain HTTP client; waits are polls with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from server_mgr.sim import textgen

FAST = [
    "--sim-startup-delay-s", "0.1",
    "--sim-warmup-s", "0.1",
    "--sim-health-latency-s", "0.02",
    "--sim-step-ms", "1",
    "--sim-step-ms-per-req", "0.01",
    "--sim-mean-output-tokens", "40",
    "--sim-drain-poll-s", "0.2",
]  # fmt: skip
USER = [{"role": "user", "content": "Tell me about caches. Ünïcödé 日本 🚀"}]


@dataclass
class Sim:
    """A running sim subprocess."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def logs(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        status, raw = self.request(method, path, body, **kw)
        return status, json.loads(raw) if raw else None

    def chat_stream(self, body: dict[str, Any], **kw: Any) -> list[Any]:
        """The SSE events of a streamed chat request: dicts, and the string ``[DONE]``."""
        status, raw = self.request("POST", "/v1/chat/completions", {**body, "stream": True}, **kw)
        assert status == 200, raw
        return parse_sse(raw)

    def wait_exit(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout=timeout)


def parse_sse(raw: bytes) -> list[Any]:
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def streamed_text(events: list[Any]) -> tuple[str, str]:
    """(reasoning_content, content) concatenated from the deltas."""
    reasoning = content = ""
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            delta = e["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    return reasoning, content


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def status_of(sim: Sim, path: str) -> int | None:
    """HTTP status of GET ``path``, or None while the port refuses connections."""
    try:
        return sim.request("GET", path, timeout=5)[0]
    except (ConnectionRefusedError, ConnectionResetError):
        return None


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., Sim]]:
    """Start sims; every one still running at teardown is killed (its own process group)."""
    started: list[Sim] = []

    def start(*args: str, ready: bool = True, fast: bool = True) -> Sim:
        port = free_port()
        log_path = tmp_path / f"sim-{port}.log"
        argv = [sys.executable, "-m", "server_mgr.sim", "--port", str(port)]
        argv += [*(FAST if fast else []), *args]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sim = Sim(proc, port, log_path)
        started.append(sim)
        if ready:
            wait_until(lambda: status_of(sim, "/health") == 200, what="/health 200")
        return sim

    yield start
    for sim in started:
        if sim.proc.poll() is None:
            os.killpg(sim.proc.pid, signal.SIGKILL)
            sim.proc.wait()


@pytest.fixture(scope="module")
def shared_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """One sim with a reasoning parser and metrics, for tests that do not need special knobs."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("shared") / "sim.log"
    argv = [
        sys.executable,
        "-m",
        "server_mgr.sim",
        "--port",
        str(port),
        *FAST,
        "--reasoning-parser",
        "qwen3",
        "--enable-metrics",
        "--served-model-name",
        "m1",
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    sim = Sim(proc, port, log_path)
    wait_until(lambda: status_of(sim, "/health") == 200, what="/health 200")
    yield sim
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def expected(messages: list[dict[str, Any]], **params: Any) -> textgen.Completion:
    params.setdefault("mean_output_tokens", 40)
    return textgen.expected_completion(messages, **params)


# --- textgen (pure) --------------------------------------------------------------------------


def test_output_is_deterministic_and_truncation_keeps_the_prefix() -> None:
    full = expected(USER, seed=7)
    assert full == expected(USER, seed=7)
    short = expected(USER, seed=7, max_tokens=5)
    assert short.tokens == full.tokens[:5] and short.finish_reason == "length"
    assert full.finish_reason == "stop" and full.content == "".join(full.tokens)
    assert all(t.startswith(" ") and " " not in t[1:] for t in full.tokens)
    assert expected(USER, seed=8).tokens != full.tokens
    # greedy decoding ignores the seed
    assert expected(USER, seed=1, temperature=0).tokens == expected(USER, temperature=0.0).tokens


def test_vocabulary_exercises_unicode_and_perturbation_keeps_length() -> None:
    assert any(not t.isascii() for t in textgen.VOCAB)
    clean = expected(USER, mean_output_tokens=400)
    noisy = expected(USER, mean_output_tokens=400, perturb=0.3)
    assert len(noisy.tokens) == len(clean.tokens)
    diff = sum(a != b for a, b in zip(clean.tokens, noisy.tokens, strict=True))
    assert 0.15 * len(clean.tokens) < diff < 0.45 * len(clean.tokens)


def test_output_stops_at_the_context_edge_without_max_tokens() -> None:
    c = expected(USER, context_length=30, mean_output_tokens=400)
    assert c.finish_reason == "length"
    assert c.completion_tokens == 30 - 2 - textgen.count_prompt_tokens(USER)


# --- lifecycle -------------------------------------------------------------------------------


def test_port_refused_then_models_before_health_then_fired_up(
    start_sim: Callable[..., Sim],
) -> None:
    sim = start_sim(
        "--sim-startup-delay-s", "0.5", "--sim-warmup-s", "1.2", "--max-total-tokens", "12345", ready=False
    )
    assert status_of(sim, "/v1/models") is None  # still loading: connection refused
    wait_until(lambda: status_of(sim, "/v1/models") == 200, what="/v1/models 200")
    assert status_of(sim, "/health") == 503
    assert status_of(sim, "/ready") == 503
    status, info = sim.json("GET", "/server_info")
    assert status == 200 and info["max_total_num_tokens"] == 12345
    assert info["version"] == "0.5.23"
    assert info["internal_states"][0]["memory_usage"]["token_capacity"] == 12345
    assert "The server is fired up" not in sim.logs()
    wait_until(lambda: status_of(sim, "/health") == 200, what="/health 200")
    assert sim.request("GET", "/health") == (200, b"")
    assert status_of(sim, "/ready") == 200
    logs = sim.logs()
    assert "The server is fired up and ready to roll!" in logs
    assert re.search(r"^\[[\d\- :]{19}\] max_total_num_tokens=12345, chunked_prefill_size=", logs, re.M)
    assert "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 12345," in logs


def test_info_endpoints_have_the_0_5_23_shapes(shared_sim: Sim) -> None:
    status, models = shared_sim.json("GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "m1"
    assert models["data"][0]["max_model_len"] == 32768
    status, missing = shared_sim.json("GET", "/v1/models/nope")
    assert status == 404 and missing["error"]["code"] == "model_not_found"
    status, _ = shared_sim.json("GET", "/get_server_info")
    assert status == 200
    assert "Endpoint '/get_server_info' is deprecated" in shared_sim.logs()
    status, info = shared_sim.json("GET", "/model_info")
    assert status == 200 and info["served_model_name"] == "m1"
    status, loads = shared_sim.json("GET", "/v1/loads")
    assert status == 200 and loads["loads"][0]["max_total_num_tokens"] == 200000
    assert shared_sim.request("POST", "/flush_cache")[0] == 200
    assert shared_sim.request("GET", "/nope")[0] == 404


# --- chat ------------------------------------------------------------------------------------


def test_stream_has_role_deltas_finish_usage_done_and_the_expected_text(shared_sim: Sim) -> None:
    body = {
        "model": "anything",
        "messages": USER,
        "seed": 3,
        "temperature": 0.7,
        "stream_options": {"include_usage": True},
    }
    events = shared_sim.chat_stream(body)
    want = expected(USER, seed=3, temperature=0.7, reasoning=True)
    role, *deltas, finish, usage, done = events
    assert done == "[DONE]"
    assert role["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert role["object"] == "chat.completion.chunk" and role["model"] == "anything"
    assert re.fullmatch(r"[0-9a-f]{32}", role["id"])
    assert {e["id"] for e in events[:-1]} == {role["id"]}
    assert {e["created"] for e in events[:-1]} == {role["created"]}
    assert all(d["choices"][0]["finish_reason"] is None for d in deltas)
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["choices"][0]["matched_stop"] == textgen.EOS_TOKEN_ID
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(want.tokens)
    assert usage["usage"]["prompt_tokens"] == textgen.count_prompt_tokens(USER)
    assert streamed_text(events) == (want.reasoning_content, want.content)
    assert want.reasoning_content and want.content


def test_non_stream_response_matches_and_rid_becomes_the_id(shared_sim: Sim) -> None:
    body = {"messages": USER, "max_completion_tokens": 6, "max_tokens": 1000, "rid": "job-1"}
    status, resp = shared_sim.json("POST", "/v1/chat/completions", body)
    want = expected(USER, max_tokens=6, reasoning=True)
    assert status == 200 and resp["id"] == "job-1" and resp["object"] == "chat.completion"
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert choice["message"]["reasoning_content"] == want.reasoning_content
    assert (choice["message"]["content"] or "") == want.content
    assert resp["usage"]["completion_tokens"] == 6
    assert resp["metadata"] == {"weight_version": "default"}


def test_continuation_of_a_partial_equals_the_uninterrupted_output(shared_sim: Sim) -> None:
    full = expected(USER, seed=11, reasoning=True)
    k = full.reasoning_tokens + 2  # cut inside the content
    # SGLang continues the raw text: reasoning, the think-end tag, content
    head = "".join(full.tokens[full.reasoning_tokens : k])
    raw_full = f"{full.reasoning_content}</think>{full.content}"
    partial: dict[str, Any] = {"role": "assistant", "content": f"{full.reasoning_content}</think>{head}"}
    body = {
        "messages": [*USER, partial],
        "seed": 11,
        "continue_final_message": True,
        "stream_options": {"include_usage": True},
    }
    events = shared_sim.chat_stream(body)
    reasoning, content = streamed_text(events)
    assert reasoning == ""
    assert partial["content"] + content == raw_full
    assert events[-2]["usage"]["completion_tokens"] == len(full.tokens) - k
    assert textgen.full_output([*USER, partial], seed=11, reasoning=True, mean_output_tokens=40) == (
        full.reasoning_content,
        full.content,
    )
    # max_tokens counts new tokens only
    status, resp = shared_sim.json("POST", "/v1/chat/completions", {**body, "max_tokens": 3})
    assert resp["choices"][0]["message"]["content"] == "".join(full.tokens[k : k + 3])
    # a partial cut inside a token is finished from the same output
    cut = {**partial, "content": partial["content"][:-2]}
    status, resp = shared_sim.json("POST", "/v1/chat/completions", {**body, "messages": [*USER, cut]})
    assert cut["content"] + resp["choices"][0]["message"]["content"] == raw_full
    # the final message's reasoning_content is not read (SGLang drops it)
    ignored = {**partial, "reasoning_content": "anything"}
    status, resp = shared_sim.json("POST", "/v1/chat/completions", {**body, "messages": [*USER, ignored]})
    assert partial["content"] + resp["choices"][0]["message"]["content"] == raw_full
    # a partial the model would not have produced is continued too (as SGLang does), differently
    bad = {**partial, "content": partial["content"] + " nonsense"}
    status, resp = shared_sim.json("POST", "/v1/chat/completions", {**body, "messages": [*USER, bad]})
    assert status == 200 and not raw_full.startswith(
        bad["content"] + resp["choices"][0]["message"]["content"]
    )


def test_abort_request_by_rid_prefix_ends_the_stream_with_abort(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--sim-step-ms", "20")

    async def run() -> list[Any]:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{sim.port}"
            body = {"messages": USER, "stream": True, "rid": "abc-123", "max_tokens": 500}
            async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
                await resp.content.readuntil(b"\n\n")  # role chunk
                await resp.content.readuntil(b"\n\n")  # first token
                async with s.post(f"{url}/abort_request", json={"rid": "abc"}) as r:
                    assert r.status == 200 and await r.read() == b""
                return parse_sse(b"data: {}\n\n" + await resp.read())[1:]

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"


def test_stream_interval_groups_tokens_and_keeps_the_text(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--stream-interval", "4")
    events = sim.chat_stream({"messages": USER, "max_tokens": 21})
    deltas = events[1:-2]
    # the first token alone, then 4 per chunk, the rest at the finish
    assert [len(d["choices"][0]["delta"]["content"].split(" ")) - 1 for d in deltas] == [
        1,
        3,
        4,
        4,
        4,
        4,
        1,
    ]
    assert streamed_text(events)[1] == expected(USER, max_tokens=21).content


# --- errors ----------------------------------------------------------------------------------


def test_context_length_errors_have_sglangs_exact_text(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--context-length", "64")
    long_msgs = [{"role": "user", "content": "x" * 400}]
    n = textgen.count_prompt_tokens(long_msgs)
    status, err = sim.json("POST", "/v1/chat/completions", {"messages": long_msgs, "stream": True})
    assert status == 400
    assert err == {
        "object": "error",
        "param": None,
        "code": 400,
        "type": "BadRequestError",
        "message": f"The input ({n} tokens) is longer than the model's context length (64 tokens).",
    }
    p = textgen.count_prompt_tokens(USER)
    status, err = sim.json("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 60})
    assert status == 400 and err["message"] == (
        "Requested token count exceeds the model's maximum context length of 64 tokens. You "
        f"requested a total of {p + 60} tokens: {p} tokens from the input messages and 60 tokens "
        "for the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit."
    )
    # exactly at the limit is accepted (0.5.23 rejects only '>')
    status, _ = sim.json("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 64 - p})
    assert status == 200


def test_auto_truncate_clamps_instead_of_refusing(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--context-length", "64", "--allow-auto-truncate", "--sim-mean-output-tokens", "400")
    p = textgen.count_prompt_tokens(USER)
    status, resp = sim.json("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 90})
    assert status == 200 and resp["usage"]["completion_tokens"] == 64 - 2 - p
    assert resp["choices"][0]["finish_reason"] == "length"
    long_msgs = [{"role": "user", "content": "x" * 400}]
    status, resp = sim.json("POST", "/v1/chat/completions", {"messages": long_msgs})
    assert status == 200 and resp["usage"] == {**resp["usage"], "prompt_tokens": 58, "completion_tokens": 4}
    assert "Truncating max_new_tokens." in sim.logs() and "Truncating the input." in sim.logs()


def test_invalid_requests_get_sglangs_messages(shared_sim: Sim) -> None:
    cases = [
        ({"messages": []}, "Messages cannot be empty."),
        (
            {"messages": USER, "temperature": -1},
            "temperature must be a non-negative finite number, got -1.0.",
        ),
        ({"messages": USER, "top_p": 0}, "top_p must be in (0, 1], got 0.0."),
        ({"messages": USER, "top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ]
    for body, message in cases:
        status, err = shared_sim.json("POST", "/v1/chat/completions", body)
        assert (status, err["message"]) == (400, message)
    status, err = shared_sim.json(
        "POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}
    )
    assert status == 400 and "role" in err["message"]
    status, raw = shared_sim.request(
        "POST", "/v1/chat/completions", None, headers={"Content-Type": "text/plain"}
    )
    assert status == 400 and b"Only 'application/json' is allowed" in raw


def test_api_key_is_required_except_on_health_and_metrics(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--api-key", "s3cret", "--enable-metrics")
    assert sim.json("GET", "/v1/models") == (401, {"error": "Unauthorized"})
    status, _ = sim.json(
        "POST",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2},
        headers={"Authorization": "Bearer wrong"},
    )
    assert status == 401
    auth = {"Authorization": "Bearer s3cret"}
    status, _ = sim.json("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2}, headers=auth)
    assert status == 200
    assert status_of(sim, "/health") == 200 and status_of(sim, "/ready") == 200
    status, raw = sim.request("GET", "/metrics")
    assert status == 200 and b"sglang:num_running_reqs{" in raw


def test_metrics_exist_only_with_enable_metrics(start_sim: Callable[..., Sim], shared_sim: Sim) -> None:
    status, raw = shared_sim.request("GET", "/metrics")
    assert status == 200
    text = raw.decode()
    for name in (
        "num_running_reqs",
        "num_queue_reqs",
        "num_used_tokens",
        "token_usage",
        "gen_throughput",
        "num_retracted_reqs",
        "max_total_num_tokens",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_requests_total",
    ):
        assert f"sglang:{name}{{" in text, name
    assert 'model_name="m1"' in text and 'engine_type="unified"' in text and 'tp_rank="0"' in text
    sim = start_sim()
    assert sim.request("GET", "/metrics")[0] == 404


def test_error_every_nth_request_gets_a_503_error_chunk_then_done(
    start_sim: Callable[..., Sim],
) -> None:
    sim = start_sim("--sim-error-every", "2")
    body = {"messages": USER, "max_tokens": 30}
    first = sim.chat_stream(body)
    assert first[-2]["choices"][0]["finish_reason"] == "length"
    second = sim.chat_stream(body)
    assert second[-1] == "[DONE]"
    assert second[-2] == {
        "error": {
            "object": "error",
            "message": "The request queue is full.",
            "type": "SERVICE_UNAVAILABLE",
            "param": None,
            "code": 503,
        }
    }
    assert 1 <= len(second) - 3 <= 3  # role chunk, a few tokens, error, [DONE]
    assert not any(
        isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"] for e in second
    )


def test_queue_full_gives_503(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--max-running-requests", "1", "--max-queued-requests", "1", "--sim-step-ms", "20")

    async def run() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{sim.port}/v1/chat/completions"
            body = {"messages": USER, "max_tokens": 40}

            async def one(delay: float) -> tuple[int, Any]:
                await asyncio.sleep(delay)
                async with s.post(url, json=body) as r:
                    return r.status, await r.json()

            return list(await asyncio.gather(one(0), one(0.15), one(0.3)))

    results = asyncio.run(run())
    assert [s for s, _ in results] == [200, 200, 503]
    assert results[2][1]["message"] == "The request queue is full."


# --- scheduler -------------------------------------------------------------------------------


def test_kv_pool_is_never_exceeded_and_retracted_requests_still_finish_right(
    start_sim: Callable[..., Sim],
) -> None:
    # every request runs to max_tokens, more than the decaying new_token_ratio reserves for it
    sim = start_sim(
        "--max-total-tokens", "900", "--sim-mean-output-tokens", "400", "--decode-log-interval", "5"
    )
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(24)]
    seen_used: list[int] = []

    async def run() -> list[tuple[str, str]]:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{sim.port}"

            async def one(msgs: list[dict[str, Any]]) -> tuple[str, str]:
                body = {"messages": msgs, "stream": True, "max_tokens": 120}
                async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                    return streamed_text(parse_sse(await r.read()))

            async def watch() -> None:
                while True:
                    async with s.get(f"{url}/v1/loads") as r:
                        load = (await r.json())["loads"][0]
                        seen_used.append(load["num_used_tokens"])
                    await asyncio.sleep(0.01)

            watcher = asyncio.create_task(watch())
            out = await asyncio.gather(*(one(m) for m in prompts))
            watcher.cancel()
            return out

    outputs = asyncio.run(run())
    for msgs, got in zip(prompts, outputs, strict=True):
        assert got == ("", expected(msgs, max_tokens=120, mean_output_tokens=400).content)
    stats = sim.json("GET", "/_sim/stats")[1]
    assert stats["peak_used_tokens"] <= 900 and max(seen_used) <= 900
    assert stats["retracted_total"] > 0 and stats["used_tokens"] == 0
    logs = sim.logs()
    assert "KV cache pool is full. Retract requests. #retracted_reqs: " in logs
    assert re.search(
        r"Decode batch, #running-req: \d+, #token: \d+, token usage: [01]\.\d\d, "
        r"cuda graph: True, gen throughput \(token/s\): [\d.]+, #queue-req: \d+",
        logs,
    )
    assert re.search(
        r"Prefill batch, #new-seq: \d+, #new-token: \d+, #cached-token: 0, "
        r"token usage: [\d.]+, #running-req: \d+, #queue-req: [1-9]\d*, ",
        logs,
    )


def test_client_disconnect_aborts_a_stalled_request(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--sim-stall-every", "1")
    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=0.5)
    body = json.dumps({"messages": USER, "stream": True, "max_tokens": 200})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    received = b""
    with pytest.raises(TimeoutError):
        while True:
            received += resp.read1(65536)  # the stall: nothing more arrives
    assert received.count(b"data: ") >= 2 and b"[DONE]" not in received
    assert sim.json("GET", "/_sim/stats")[1]["inflight"] == 1
    conn.close()
    wait_until(lambda: sim.json("GET", "/_sim/stats")[1]["inflight"] == 0, what="abort")


def test_health_stall_fault_wedges_health_until_lifted(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim()
    assert sim.json("POST", "/_sim/fault", {"health_stall": True})[0] == 200
    with pytest.raises(TimeoutError):
        sim.request("GET", "/health", timeout=0.3)
    sim.json("POST", "/_sim/fault", {"health_stall": False})
    assert status_of(sim, "/health") == 200


def test_log_level_warning_hides_batch_lines_and_tp_adds_the_rank_prefix(
    start_sim: Callable[..., Sim],
) -> None:
    quiet = start_sim("--log-level", "warning")
    loud = start_sim("--tp-size", "2")
    for sim in (quiet, loud):
        assert sim.json("POST", "/v1/chat/completions", {"messages": USER})[0] == 200
    assert "Prefill batch" not in quiet.logs() and "Decode batch" not in quiet.logs()
    logs = loud.logs()
    assert re.search(r"^\[[\d\- :]{19} TP0\] Prefill batch, ", logs, re.M)
    assert re.search(r"^\[[\d\- :]{19} TP0\] max_total_num_tokens=200000, ", logs, re.M)
    assert re.search(r"^\[[\d\- :]{19}\] The server is fired up and ready to roll!$", logs, re.M)


# --- process behaviour -----------------------------------------------------------------------


def test_sigterm_drains_in_flight_streams_then_exits_0(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--sim-step-ms", "10", "--sim-mean-output-tokens", "400")

    async def run() -> list[Any]:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{sim.port}"
            body = {"messages": USER, "stream": True, "max_tokens": 100}
            async with s.post(f"{url}/v1/chat/completions", json=body) as resp:
                head = await resp.content.readuntil(b"\n\n")
                sim.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:  # until the signal is handled
                    async with s.get(f"{url}/health") as h:
                        if h.status == 503:
                            break
                else:
                    raise AssertionError("/health never turned 503 after SIGTERM")
                return parse_sse(head + await resp.read())

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    assert streamed_text(events)[1] == expected(USER, max_tokens=100, mean_output_tokens=400).content
    assert sim.wait_exit() == 0
    logs = sim.logs()
    assert "SIGTERM received. signum=15 frame=None. Draining requests and shutting down..." in logs
    assert "Gracefully exiting... Remaining number of requests 1." in logs


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--mem-fraction-static", "0.95", "--sim-oom-above", "0.9"],
            "Capture cuda graph failed: CUDA out of memory. Tried to allocate ",
        ),
        (
            ["--mem-fraction-static", "0.5", "--sim-oom-below", "0.6"],
            "ValueError: Loaded weights leave no GPU memory for the KV cache under "
            "--mem-fraction-static=0.5. "
            "Raise --mem-fraction-static above 0.600",
        ),
    ],
)
def test_startup_oom_knobs_log_sglangs_line_and_die(
    start_sim: Callable[..., Sim], args: list[str], line: str
) -> None:
    sim = start_sim(*args, ready=False)
    assert sim.wait_exit() == -signal.SIGKILL
    logs = sim.logs()
    assert (
        line in logs and "Received sigquit from a child process. It usually means the child failed." in logs
    )
    assert "Uvicorn running" not in logs


def test_crash_after_requests_logs_the_crash_and_dies(start_sim: Callable[..., Sim]) -> None:
    sim = start_sim("--sim-crash-after-requests", "2")
    assert sim.json("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 3})[0] == 200
    with contextlib.suppress(ConnectionError, http.client.HTTPException):
        sim.request("POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 3})
    assert sim.wait_exit() == -signal.SIGKILL
    assert "Scheduler hit an exception: Traceback" in sim.logs()
