"""Riding out Redis: a ledger transition repeated through a restart or a blip.

Transitions are fenced and idempotent, so repeating one after a lost reply is safe. Both forms
try for up to ``REDIS_RETRY_S``, backing off from 0.1 to 2 s, then let the error through (the
job's lease then expires and the pump requeues it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

log = logging.getLogger("tokenmill.worker")
T = TypeVar("T")
REDIS_RETRY_S = 120.0
_PASSING = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


class _Backoff:
    def __init__(self) -> None:
        self.deadline = time.monotonic() + REDIS_RETRY_S
        self.delay = 0.1

    def pause(self, exc: redis.RedisError) -> float:
        """How long to wait before the next try; ``exc`` again once time is up."""
        if time.monotonic() > self.deadline:
            raise exc
        log.warning("Redis unavailable (%s); retrying", exc)
        delay, self.delay = self.delay, min(self.delay * 2, 2.0)
        return delay


def durable(fn: Callable[[], T]) -> T:
    """``fn()``, repeated while Redis is unavailable (on a thread)."""
    backoff = _Backoff()
    while True:
        try:
            return fn()
        except _PASSING as exc:
            time.sleep(backoff.pause(exc))


async def adurable(fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()``, repeated while Redis is unavailable (on the loop, which goes on meanwhile)."""
    backoff = _Backoff()
    while True:
        try:
            return await fn()
        except _PASSING as exc:
            await asyncio.sleep(backoff.pause(exc))
