"""The ledger's asynchronous executor: :mod:`tokenmill.transitions`' calls run on the worker's
event loop, through its pipelined client (:mod:`tokenmill.redis_async`).

A job runs from delivery to commit, and settles an error, in hand-offs to the loop
(:mod:`workers.job_path`, :mod:`workers.job`); the watch's heartbeats ride the same connection
(:mod:`workers.watch`). Riding out Redis is the callers' (:mod:`tokenmill.redis_retry`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TypeVar

import redis

from tokenmill.redis_async import LoopRedis, LoopScript
from tokenmill.transitions import Call, script_source

R = TypeVar("R")
SCRIPTS = {
    name: LoopScript(script_source(name))
    for name in ("claim", "start", "wait", "commit", "finish", "heartbeat", "release", "fail", "qref_sample")
}  # load them on the client's connections: LoopRedis(url, scripts=SCRIPTS.values())


class AsyncLedger:
    """Transitions on a :class:`~tokenmill.redis_async.LoopRedis` (call on its loop)."""

    def __init__(self, client: LoopRedis) -> None:
        self.r = client

    async def call(self, call: Call[R]) -> R:
        if not call.script:
            return call.decode(await self.r.call(*call.args))
        return call.decode(await self.r.evalsha(SCRIPTS[call.script], call.keys, call.args))

    async def calls(self, calls: Sequence[Call[R]]) -> list[R | redis.ResponseError]:
        """Several calls at once, pipelined on the one connection (not a transaction: each script
        is atomic on its own): each one's reply, or the error its script raised. A lost
        connection (or any other error) raises for all of them."""
        out: list[R | redis.ResponseError] = []
        for reply in await asyncio.gather(*map(self.call, calls), return_exceptions=True):
            if isinstance(reply, BaseException) and not isinstance(reply, redis.ResponseError):
                raise reply
            out.append(reply)
        return out
