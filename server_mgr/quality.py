"""The quality gate: compare a candidate server config against a reference on fixed prompts.

Both sides answer the same prompts with greedy decoding (temperature 0) and a fixed seed; the
outputs are compared word by word (a whitespace-delimited word stands in for a token, since the
manager has no tokenizer). Reported: the exact-match rate, the mean shared-prefix fraction
(common leading words / the longer output) and the median position of the first differing word
among the outputs that differ. The check passes when the mean shared-prefix fraction reaches the
threshold. A config side is launched through the same supervisor as ``server up``, but publishes
nothing in Redis, so no worker sends it work.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from server_mgr.config import ServerConfig
from server_mgr.reporting import LogReporter
from server_mgr.supervisor import Supervisor
from tokenmill import servers
from tokenmill.errors import InputError, InvalidRequestError, ServerStartError, ServerUnavailableError
from tokenmill.url_secrets import redact_url

_WORD_RE = re.compile(r"\s*\S+|\s+$")


@dataclass(frozen=True, slots=True)
class Side:
    """One side of the comparison: a running server's URL, or a config to launch."""

    label: str
    url: str | None = None
    config: ServerConfig | None = None
    api_key: str | None = None
    model: str = "default"


@dataclass(frozen=True, slots=True)
class Comparison:
    """Agreement of two output lists, and the verdict against ``threshold``."""

    prompts: int
    exact_match_rate: float
    mean_prefix_fraction: float
    median_first_divergence_words: float | None
    diverged: int
    threshold: float

    @property
    def passed(self) -> bool:
        return self.mean_prefix_fraction >= self.threshold

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def words(text: str) -> list[str]:
    """``text`` as words, each with its leading whitespace (so joining them gives ``text``)."""
    return _WORD_RE.findall(text)


def compare(reference: list[str], candidate: list[str], threshold: float) -> Comparison:
    """Agreement of ``candidate`` with ``reference`` (same prompts, same order)."""
    fractions: list[float] = []
    divergences: list[int] = []
    for ref, cand in zip(reference, candidate, strict=True):
        a, b = words(ref), words(cand)
        # the leading words the two have in common
        common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        longest = max(len(a), len(b))
        fractions.append(1.0 if longest == 0 else common / longest)
        if ref != cand:
            divergences.append(common)
    n = len(reference)
    return Comparison(
        prompts=n,
        exact_match_rate=(n - len(divergences)) / n if n else 1.0,
        mean_prefix_fraction=sum(fractions) / n if n else 1.0,
        median_first_divergence_words=statistics.median(divergences) if divergences else None,
        diverged=len(divergences),
        threshold=threshold,
    )


def load_prompts(path: Path) -> list[list[dict[str, Any]]]:
    """The chat messages of each JSONL row (``messages``, or ``prompt`` as one user message)."""
    prompts: list[list[dict[str, Any]]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        source = f"{path}:{number}"
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise InputError(source, f"not valid JSON: {exc}") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            prompts.append(row["messages"])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append([{"role": "user", "content": row["prompt"]}])
        else:
            raise InputError(source, "expected an object with 'messages' (a list) or 'prompt' (a string)")
    if not prompts:
        raise InputError(str(path), "no prompts")
    return prompts


def run_check(
    reference: Side,
    candidate: Side,
    prompts: list[list[dict[str, Any]]],
    *,
    threshold: float,
    max_tokens: int,
    seed: int = 0,
    concurrency: int = 1,
) -> Comparison:
    """Answer ``prompts`` on each side in turn (launching and stopping configs), then compare."""
    outputs = []
    for side in (reference, candidate):
        with _serving(side) as url:
            outputs.append(asyncio.run(generate_all(url, side, prompts, max_tokens, seed, concurrency)))
    return compare(outputs[0], outputs[1], threshold)


@contextmanager
def _serving(side: Side) -> Iterator[str]:
    """The side's base URL; a config side is launched first and stopped afterwards."""
    if side.config is None:
        yield (side.url or "").rstrip("/")
        return
    supervisor = Supervisor(side.config, LogReporter())
    thread = threading.Thread(target=supervisor.run, name=f"quality-{side.label}", daemon=True)
    thread.start()
    try:
        state = supervisor.wait_for((servers.READY, servers.FAILED), side.config.startup_timeout_s)
        if state != servers.READY:
            raise ServerStartError(
                f"the {side.label} server {side.config.name!r} did not become "
                f"ready: {supervisor.record.last_error or state}"
            )
        yield side.config.probe_url
    finally:
        supervisor.hurry.set()
        supervisor.stop_event.set()
        thread.join(timeout=side.config.stop_grace_s + 30)


async def generate_all(
    base_url: str,
    side: Side,
    prompts: list[list[dict[str, Any]]],
    max_tokens: int,
    seed: int,
    concurrency: int,
) -> list[str]:
    """Greedy completions of every prompt (reasoning text, if separated, comes first)."""
    headers = {"Authorization": f"Bearer {side.api_key}"} if side.api_key else {}
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:

        async def one(messages: list[dict[str, Any]]) -> str:
            body = {
                "model": side.model,
                "messages": messages,
                "temperature": 0,
                "seed": seed,
                "max_tokens": max_tokens,
                "stream": False,
            }
            async with limit, session.post(f"{base_url}/v1/chat/completions", json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    error = InvalidRequestError if resp.status < 500 else ServerUnavailableError
                    raise error(
                        f"{redact_url(base_url)} answered {resp.status}: {text[:300]}", status=resp.status
                    )
            message = orjson.loads(text)["choices"][0]["message"]
            return (message.get("reasoning_content") or "") + (message.get("content") or "")

        return list(await asyncio.gather(*(one(m) for m in prompts)))
