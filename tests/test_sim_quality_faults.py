"""The sim's degrade switch (``POST /_sim/fault`` ``{"degrade": ...}``) against tokenmill's
quality flags: each degraded mode is flagged on the outputs it writes from the moment it is set,
and healthy outputs to the same requests never are (over several sim seeds)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from server_mgr.sim.decode import DEGRADES
from tests.procs import start_sim
from tests.test_quality import SCHEMA, TOOLS
from tokenmill import quality as q
from tokenmill.lengths import bin_of

MAX_TOKENS = 400  # the sim's outputs here (mean 40 tokens) end by EOS at 70 tokens at most
KINDS: dict[str, dict[str, Any]] = {
    "text": {},
    "text, no thinking": {"chat_template_kwargs": {"enable_thinking": False}},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    },
    "json_object": {"response_format": {"type": "json_object"}},
    "regex": {"regex": "[a-z]{3,8}-[0-9]{2,4}"},
    "tools": {**TOOLS, "tool_choice": "required"},
}
STRUCTURED = {
    "json_schema": q.INVALID_STRUCTURED,
    "json_object": q.INVALID_STRUCTURED,
    "regex": q.INVALID_STRUCTURED,
}
# the flag every output of each degraded mode must carry (broken_json: per kind)
EXPECTED = {"loop": q.REPETITION, "truncate": q.LENGTH, "empty": q.EMPTY}


def bodies(n: int, first: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """``n`` requests, the kinds in turn, each its own prompt."""
    names = list(KINDS)
    out = []
    for i in range(first, first + n):
        kind = names[i % len(names)]
        prompt = f"Question {i}: what does a {kind} answer to this look like?"
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS,
        }
        out.append((kind, {**body, **KINDS[kind]}))
    return out


def result_of(answer: dict[str, Any]) -> dict[str, Any]:
    """The result the worker commits for an answer (workers/attempt.py: a call cut by
    max_tokens is not kept)."""
    choice = answer["choices"][0]
    message = choice["message"]
    result = {
        "content": message.get("content") or "",
        "reasoning_content": message.get("reasoning_content"),
        "finish_reason": choice["finish_reason"],
        "usage": answer["usage"],
    }
    if message.get("tool_calls") and choice["finish_reason"] != "length":
        result["tool_calls"] = message["tool_calls"]
    return result


def judge(url: str, requests: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any], int]]:
    """(kind, result, flags) of each request's answer, asked all at once."""

    async def ask(session: aiohttp.ClientSession, body: dict[str, Any]) -> dict[str, Any]:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer: dict[str, Any] = await resp.json()
            return answer

    async def everything() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(ask(session, body) for _, body in requests))

    results = [result_of(a) for a in asyncio.run(everything())]
    return [(kind, r, q.flags(r, body, None)) for (kind, body), r in zip(requests, results, strict=True)]


def fault(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url + "/_sim/fault", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_degraded_modes_are_flagged_and_a_healthy_sim_never(tmp_path: Path, seed: int) -> None:
    proc, url = start_sim(
        tmp_path, "--sim-seed", str(seed), "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"
    )
    try:
        healthy = judge(url, bodies(240))
        assert_healthy(healthy)
        for mode in DEGRADES:
            assert_degraded(url, mode, healthy[:24])
        status, body = fault(url, {"degrade": "melt"})
        assert status == 400 and "loop, truncate, broken_json, empty" in body["error"]
        assert fault(url, {})[1]["degrade"] is None
    finally:
        proc.stop()


def assert_healthy(judged: list[tuple[str, dict[str, Any], int]]) -> None:
    """No output flagged, and at most 2% outside the run's own p1..p99 lengths."""
    flagged = [(kind, r) for kind, r, mask in judged if mask]
    assert not flagged, flagged[:3]
    assert {kind for kind, _, _ in judged} == set(KINDS)
    assert sum(1 for _, r, _ in judged if r.get("tool_calls")) == len(judged) // len(KINDS)
    lengths = [r["usage"]["completion_tokens"] for _, r, _ in judged]
    bounds = q.LengthBounds.from_histogram(Counter(bin_of(n) for n in lengths))
    assert bounds is not None
    assert sum(bounds.outside(n) for n in lengths) <= 0.02 * len(lengths)


def assert_degraded(url: str, mode: str, healthy: list[tuple[str, dict[str, Any], int]]) -> None:
    """From the switch on, the same requests' outputs carry the mode's flag; switched off, they
    are the healthy ones again."""
    faults = {"health_stall": False, "stall_streams": False, "ignore_stop": False}
    requests = bodies(len(healthy))
    try:
        assert fault(url, {"degrade": mode}) == (200, {**faults, "degrade": mode})
        degraded = judge(url, requests)
    finally:
        assert fault(url, {"degrade": None})[1]["degrade"] is None
    healed = judge(url, requests)
    texts = [
        [(r["content"], r["reasoning_content"], r["usage"]) for _, r, _ in rs] for rs in (healthy, healed)
    ]
    assert texts[0] == texts[1]
    for kind, r, mask in degraded:
        if mode == "broken_json":
            want = STRUCTURED.get(kind, q.TOOL_CALL_ERRORS if kind == "tools" else 0)
            assert mask == want, (mode, kind, r, mask)
        elif mode == "loop" and kind == "tools":  # a loop in a call: the parser drops the cut call
            assert mask & q.LENGTH and mask & (q.REPETITION | q.EMPTY), (mode, kind, r, mask)
        else:
            assert mask & EXPECTED[mode], (mode, kind, r, mask)
    if mode in ("loop", "truncate"):
        free = [r for kind, r, _ in degraded if kind.startswith("text")]
        assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in free)
