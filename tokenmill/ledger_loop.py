"""A job's usual transitions on the worker's event loop: peek, the waiting lease, claim (or
admit and claim), commit.

The same scripts, keys and arguments as :class:`~tokenmill.ledger.Ledger`'s (built by the same
functions), sent through the loop's pipelined client (:mod:`tokenmill.loop_redis`), so that a job
runs from delivery to commit in one hand-off to the loop (:mod:`workers.job_path`). Settling an
error, and riding out Redis, are left to the synchronous ledger, on the task's thread.
"""

from __future__ import annotations

from typing import Any

from tokenmill import keys
from tokenmill.ledger import (
    PEEK_FIELDS,
    AdmitRequest,
    Claim,
    Full,
    LengthReport,
    Peek,
    _s,
    claim_call,
    claimed,
    commit_call,
    peeked,
    script_source,
    start_call,
    started,
    wait_call,
)
from tokenmill.loop_redis import LoopRedis, LoopScript

SCRIPTS = {
    name: LoopScript(script_source(name)) for name in ("claim", "start", "wait", "commit", "finish")
}  # load them on the client's connections: LoopRedis(url, scripts=SCRIPTS.values())


class LoopLedger:
    """One run's worker transitions on a :class:`~tokenmill.loop_redis.LoopRedis`."""

    def __init__(self, client: LoopRedis, run: str) -> None:
        self.r = client
        self.run = run
        self.k = keys.RunKeys(run)

    async def peek(self, job_id: str) -> Peek | None:
        """As :meth:`Ledger.peek <tokenmill.ledger.Ledger.peek>`."""
        return peeked(await self.r.call("HMGET", self.k.job(job_id), *PEEK_FIELDS))

    async def claim(self, job_id: str, worker: str, lease_ttl_s: float) -> Claim | str:
        """As :meth:`Ledger.claim <tokenmill.ledger.Ledger.claim>`."""
        res = await self.r.evalsha(SCRIPTS["claim"], *claim_call(self.k, job_id, worker, lease_ttl_s))
        return claimed(self.run, job_id, res)

    async def start(
        self, job_id: str, worker: str, lease_ttl_s: float, admit: AdmitRequest, spec: dict[str, Any]
    ) -> Claim | Full | str:
        """As :meth:`Ledger.start <tokenmill.ledger.Ledger.start>`."""
        res = await self.r.evalsha(SCRIPTS["start"], *start_call(self.k, job_id, worker, lease_ttl_s, admit))
        return started(self.run, job_id, res, admit, spec)

    async def commit(
        self,
        claim: Claim,
        result: dict[str, Any],
        new_tokens: int,
        lengths: LengthReport | None,
        release_slot: bool,
    ) -> str:
        """As :meth:`Ledger.commit <tokenmill.ledger.Ledger.commit>`."""
        name, script_keys, args = commit_call(self.k, claim, result, new_tokens, lengths, release_slot)
        return _s(await self.r.evalsha(SCRIPTS[name], script_keys, args))

    async def hold_waiting(self, job_id: str, lease_ttl_s: float, hold: bool = True) -> None:
        """As :meth:`Ledger.hold_waiting <tokenmill.ledger.Ledger.hold_waiting>`."""
        await self.r.evalsha(SCRIPTS["wait"], *wait_call(self.k, job_id, lease_ttl_s, hold))
