"""Finishing jobs without a GPU or a worker: each job of a run is claimed and committed through
the ledger's own transitions with the sim's deterministic output, as a worker would commit it.

Sealing tests and ``bench/results.py`` use this to make thousands of ``done`` jobs in seconds;
what they check (shards, exports, Redis memory) depends only on the ledger's state, which is the
same as after a real worker's commits. The pipeline tests cover the real workers.
"""

from __future__ import annotations

from collections.abc import Iterable

import orjson
import redis

from server_mgr.sim.textgen import expected_completion
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.transitions import Claim


def all_job_ids(client: redis.Redis, run: str) -> list[str]:
    """Every job id of ``run``, partition by partition, in enqueue order."""
    k = keys.RunKeys(run)
    out: list[str] = []
    for part in sorted(p.decode() for p in client.smembers(k.partitions())):
        out += [x.decode() for x in client.lrange(k.jobs(part), 0, -1)]
    return out


def job_request(client: redis.Redis, run: str, job_id: str) -> dict[str, object]:
    """The request a job sends (its spec's ``request``)."""
    return orjson.loads(client.hget(keys.RunKeys(run).job(job_id), "spec"))["request"]


def finish_jobs(
    client: redis.Redis,
    run: str,
    job_ids: Iterable[str] | None = None,
    *,
    mean_output_tokens: int,
    reasoning: bool = True,
) -> int:
    """Claim and commit ``job_ids`` (default: every job of ``run``) with the sim's output for
    each request; returns how many were committed."""
    ledger = Ledger(client, run)
    committed = 0
    for job_id in list(job_ids) if job_ids is not None else all_job_ids(client, run):
        claim = ledger.call(t.claim(ledger.k, job_id, "finisher", 60))
        if not isinstance(claim, Claim):
            continue
        request = claim.spec["request"]
        want = expected_completion(
            request["messages"],
            seed=request.get("seed"),
            temperature=request.get("temperature"),
            top_p=request.get("top_p"),
            max_tokens=request["max_tokens"],
            reasoning=reasoning,
            mean_output_tokens=mean_output_tokens,
        )
        usage = {"prompt_tokens": want.prompt_tokens, "completion_tokens": want.completion_tokens}
        if reasoning:  # as a worker records what SGLang's usage reports
            usage["reasoning_tokens"] = want.reasoning_tokens
        result = {
            "content": want.content,
            "reasoning_content": want.reasoning_content or None,
            "finish_reason": want.finish_reason,
            "usage": usage,
            "model": request["model"],
            "attempt": claim.attempt,
            "continued_tokens": 0,
            "ttft_s": None,
            "decode_tps": None,
        }
        committed += ledger.call(t.commit(ledger.k, claim, result, want.completion_tokens)) == "ok"
    return committed
