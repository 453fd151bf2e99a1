"""Riding out Redis: a ledger transition repeated through a restart, a blip or a failover.

Transitions are fenced and idempotent, so repeating one after a lost reply is safe. A call is
tried for up to ``REDIS_RETRY_S``, backing off from 0.1 to 2 s, then let the error through (the
job's lease then expires and the upkeep requeues it). Each try is bounded by the client's own
deadline (``socket_timeout``), so a Redis host that vanished costs a try seconds, not minutes.

Two things are not ridden out: credentials Redis refused (a wrong password does not heal by
waiting: one clear error, at once), and a worker whose shutdown grace is over (``stop``: one
more try, then the error; the job's lease and the upkeep take it from there).
The synchronous clients (:mod:`tokenmill.redis_conn`) wait the same :data:`BACKOFF`, for one
retry at most: a CLI command on a dead Redis says so within seconds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis
from redis.backoff import ExponentialBackoff

from tokenmill.errors import refused

log = logging.getLogger("tokenmill.worker")
T = TypeVar("T")
REDIS_RETRY_S = 120.0
BACKOFF = ExponentialBackoff(cap=2.0, base=0.05)  # after the nth failure, base * 2**n: 0.1, 0.2 ... 2 s
_PASSING = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


async def ride_out(fn: Callable[[], Awaitable[T]], stop: threading.Event | None = None) -> T:
    """``await fn()``, repeated while Redis is unavailable (on the loop, which goes on meanwhile):
    the error again once time is up (or the worker stops), a :class:`RedisUnavailableError` at
    once for refused credentials."""
    deadline = time.monotonic() + REDIS_RETRY_S
    tries = 0
    while True:
        try:
            return await fn()
        except _PASSING as exc:
            if isinstance(exc, redis.AuthenticationError):
                raise refused(exc) from exc
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise
            tries += 1
            # one warning per transition ridden out; the tries after it are the same news
            (log.warning if tries == 1 else log.debug)("Redis unavailable (%s); retrying", exc)
            await asyncio.sleep(BACKOFF.compute(tries))
