"""The generate task's body: the job runs on the worker's loop from peek to commit
(:mod:`workers.job_path`); an attempt that ends in an error is settled here, on the loop too.

Errors are mapped to ledger states here and only here: terminal → ``failed``; retryable →
``queued`` with a backoff (no retry burned while the server is down); shutdown → checkpointed
and released at once; ``cancel --now`` → checkpointed and released, which ends the job
``cancelled``; a stale claim → nothing (another worker owns the job).

The task's thread waits on the loop with a deadline too: once the shutdown's grace is over, it
gives the loop ``ABANDON_AFTER_S`` more (a commit or release riding out a Redis that vanished),
then leaves the job to its lease, so that a warm shutdown ends even while Redis is gone.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import time
from typing import TypeVar

import redis

from tokenmill import errors, keys
from tokenmill import transitions as t
from tokenmill.redis_retry import ride_out
from workers import job_path
from workers.attempt import Attempted
from workers.runtime import Runtime

T = TypeVar("T")

log = logging.getLogger("tokenmill.worker")
ABANDON_AFTER_S = 5.0  # after the shutdown's grace: how long a thread still waits for its job
WAIT_SLICE_S = 1.0  # how often a waiting thread looks at the shutdown


def run_job(rt: Runtime, run: str, job_id: str) -> str:
    """Run one delivery of ``job_id`` on the worker's loop (:mod:`workers.job_path`); settle here
    the error its attempt ended with. Returns what happened (for logs and tests)."""
    if rt.auth_error is not None or rt.stopping.is_set():
        return "skipped"
    left = wait_on_loop(rt, rt.loop.submit(job_path.run_job(rt, run, job_id)), f"{run}/{job_id}")
    return left if isinstance(left, str) else conclude(rt, left)


def wait_on_loop(rt: Runtime, fut: concurrent.futures.Future[T], job: str) -> T | str:
    """The job's result from the loop; ``"abandoned"`` (the job cancelled on the loop, left to
    its lease) if it is still not there ``ABANDON_AFTER_S`` after the shutdown's grace."""
    aborted_at = 0.0
    while True:
        try:
            return fut.result(timeout=WAIT_SLICE_S)
        except concurrent.futures.TimeoutError:
            if not rt.abort_streams.is_set():
                continue
            now = time.monotonic()
            aborted_at = aborted_at or now
            if now - aborted_at >= ABANDON_AFTER_S:
                fut.cancel()
                log.warning(
                    "job %s: still waiting on Redis after the shutdown's grace; left to its lease", job
                )
                return "abandoned"


def conclude(rt: Runtime, done: Attempted) -> str:
    """Settle the error an attempt ended with, on the loop, riding out Redis, and give its
    admission slot back."""
    try:
        if isinstance(done.error, errors.StaleClaimError):
            log.warning("%s", done.error)
            return "stale"
        assert done.error is not None
        call = _settle(rt, done.claim, done.url, done.error, done.state.checkpoint())
        try:
            settle = ride_out(lambda: rt.async_ledger.call(call), rt.abort_streams)
            return wait_on_loop(rt, rt.loop.submit(settle), f"{done.claim.run}/{done.claim.job_id}")
        except redis.RedisError as exc:
            if not rt.abort_streams.is_set():
                raise
            log.warning(
                "job %s/%s: not released (%s); left to its lease", done.claim.run, done.claim.job_id, exc
            )
            return "abandoned"
    finally:
        try:
            rt.admission.release(done.slot)
        except redis.RedisError as exc:  # the slot's lease expires on its own
            log.warning("could not release an admission slot: %s", exc)


def _settle(
    rt: Runtime, claim: t.Claim, url: str, exc: errors.GenerationError, checkpoint: t.Checkpoint
) -> t.Call[str]:
    """The transition that settles ``exc``: fail or release (now, or after a backoff)."""
    s, k = rt.settings, keys.RunKeys(claim.run)
    err = t.JobError(exc.error_class, exc.message)
    if isinstance(exc, errors.AuthError):
        if rt.auth_error is None:
            rt.auth_error = exc.message
            log.error(
                "the server refused the API key (%s): this worker stops claiming jobs. "
                "Set TOKENMILL_API_KEY to the server's --api-key and restart the worker.",
                exc.message,
            )
    elif isinstance(exc, errors.TerminalError):
        log.warning("job %s/%s failed: %s: %s", claim.run, claim.job_id, err.error_class, err.message)
        return t.fail(k, claim, err)
    delay_s, burn = 0.0, False
    if not isinstance(exc, errors.AuthError | errors.ShutdownError | errors.JobCancelledError):
        down = rt.pool.is_down(url)
        delay = backoff_s(s.retry_backoff_s, s.retry_backoff_max_s, claim.retries)
        log.warning(
            "job %s/%s: %s (%s); %s",
            claim.run,
            claim.job_id,
            err.error_class,
            err.message,
            "server down: released without burning a retry" if down else f"retry in {delay:.1f}s",
        )
        delay_s, burn = s.server_wait_s if down else delay, not down
    return t.release(
        k, claim, err, delay_s=delay_s, burn=burn, max_attempts=s.max_attempts, checkpoint=checkpoint
    )


def backoff_s(base: float, cap: float, retries: int) -> float:
    """Exponential backoff with full jitter on its upper half."""
    ceiling: float = min(cap, base * (2**retries))
    return ceiling / 2 + random.random() * ceiling / 2
