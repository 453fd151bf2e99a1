"""Prefix affinity's leader rule against real SGLang 0.5.23: what it relies on is that SGLang sends
a stream's first chunk after the prefill, with the prompt then in its radix cache, so that the
samples sent at the leader's first token find it cached (``workers/admission/affinity.py``).

One real server is listed twice, once through a TCP proxy on loopback: tokenmill sees two
servers (and applies its rules), SGLang one radix cache and one log, whose ``Prefill batch``
lines count the prompt tokens it computed and found cached.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
import redis

from tests.engines import API_KEY, PLAIN_FLAGS, start_engine
from tests.faultproxy import FaultProxy
from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import Proc, start_worker, worker_env
from tokenmill import keys

pytestmark = pytest.mark.sglang
PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")
SAMPLES = 4


def prefilled(log: str) -> tuple[int, int]:
    """(prompt tokens computed, found cached) over the log's prefill batches."""
    new = cached = 0
    for m in PREFILL.finditer(log):
        new += int(m.group(2))
        cached += int(m.group(3))
    return new, cached


def prompt_tokens(rclient: redis.Redis, job: str) -> int:
    return int(orjson.loads(rclient.hget(keys.RunKeys("aff").job(job), "result"))["usage"]["prompt_tokens"])


def test_the_samples_of_a_prompt_are_prefilled_once_when_the_first_leads(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given one real SGLang server under two names, and two long prompts with 4 samples each
    own = start_engine("sglang", tmp_path, *PLAIN_FLAGS, api_key=API_KEY)
    try:
        with FaultProxy(own.port) as proxy:
            urls = [own.url, f"http://{proxy.address()}"]
            env = worker_env(redis_url, ",".join(urls), api_key=API_KEY)
            words = "the radix cache keeps every prefilled prompt for the next request that shares it"
            rows = [{"id": str(i), "prompt": f"prompt {i}: " + " ".join([words] * 12)} for i in range(2)]
            before = prefilled(own.output())
            # When they run on one worker, every sample delivered at once
            cli("enqueue", str(write_jsonl(tmp_path / "A.jsonl", rows)), "--run", "aff", "--samples",
                str(SAMPLES), "--temperature", "0", "--short-max-tokens", "8", env=env)  # fmt: skip
            procs.append(start_worker(tmp_path, "short", env, concurrency=16))
            doc = wait_run_finished(rclient, "aff", 180)
        after = prefilled(own.output())
    finally:
        own.stop()
    assert doc["totals"]["done"] == 2 * SAMPLES
    prompts = [[prompt_tokens(rclient, f"A:{i}#{s}") for s in range(SAMPLES)] for i in range(2)]
    once = sum(p[0] for p in prompts)
    assert min(once, *(t for p in prompts for t in p)) > 150
    # Then SGLang computed each prompt about once (its first sample) and found it cached for the
    # other three (each recomputes its last token or so), where sent together all four are
    # computed; a few tokens more for health probes
    new, cached = after[0] - before[0], after[1] - before[1]
    assert new <= once + 2 * (SAMPLES - 1) * 16 + 16, (new, cached, prompts)
    assert cached >= sum(map(sum, prompts)) - once - 2 * (SAMPLES - 1) * 16, (new, cached, prompts)
