"""The generate task's body: claim → wait for a server → stream → commit, or settle the error.

Errors are mapped to ledger states here and only here: terminal → ``failed``; retryable →
``queued`` with a backoff (no retry burned while the server is down); shutdown → checkpointed
and released at once; ``cancel --now`` → checkpointed and released, which ends the job
``cancelled``; a stale claim → nothing (another worker owns the job).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from tokenmill import errors
from tokenmill.admission import Slot
from tokenmill.ledger import Checkpoint, Claim, JobError, Ledger
from workers.attempt import Outcome, run_attempt
from workers.pool import ServerView
from workers.runtime import Runtime
from workers.stream import Progress
from workers.watch import AttemptState

log = logging.getLogger("tokenmill.worker")
T = TypeVar("T")
LINE_CHECK_S = 0.5  # how often a thread behind the head looks at the stop flag


def run_job(rt: Runtime, run: str, job_id: str) -> str:
    """Run one delivery of ``job_id``; returns what happened (for logs and tests)."""
    if rt.auth_error is not None or rt.stopping.is_set():
        return "skipped"
    ledger = rt.ledger(run)
    peeked = durable(lambda: ledger.peek(job_id))
    if peeked is None:
        return "missing"
    if peeked.state in ("done", "failed", "cancelled"):
        return peeked.state
    started = _admit(rt, ledger, job_id, peeked.spec, peeked.queue, ahead=peeked.attempts > 0)
    if started is None:
        return "stopping"
    if isinstance(started, str):
        log.info("job %s/%s not claimed: %s", run, job_id, started)
        return started
    server, slot, claim = started
    released = False
    try:
        outcome, released = _run(rt, ledger, claim, server.url, slot)
        return outcome
    finally:
        if not released:
            try:
                rt.admission.release(slot)
            except redis.RedisError as exc:  # the slot's lease expires on its own
                log.warning("could not release an admission slot: %s", exc)


REDIS_RETRY_S = 120.0


def durable(fn: Callable[[], T]) -> T:
    """Call a ledger transition, riding through a Redis restart or blip (transitions are fenced
    and idempotent, so repeating one after a lost reply is safe)."""
    deadline = time.monotonic() + REDIS_RETRY_S
    delay = 0.1
    while True:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("Redis unavailable (%s); retrying", exc)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def _admit(
    rt: Runtime, ledger: Ledger, job_id: str, spec: dict, queue: str, ahead: bool = False
) -> tuple[ServerView, Slot, Claim] | str | None:
    """Wait for a ready server with room for this request in its budget (least loaded first),
    and claim the job with the slot in the same round trip (``start.lua``). Returns the server,
    the slot and the claim; why the job could not be claimed (nothing admitted); or None when
    the worker stops first.

    Waiting threads stand in this process's line: only the first asks Redis for room, at once
    when a slot is freed here and every ``admission_wait_s`` for slots freed elsewhere. A job
    whose earlier attempt was cut (``ahead``) goes before the jobs that never ran. While
    it waits the job holds a waiting lease, so that if this worker dies the job is republished
    at once instead of when the broker's visibility timeout restores the message; a job
    admitted at once never needs one, and the claim drops it (no Redis call of its own).
    """
    s = rt.settings
    said = False
    held_at = 0.0
    claimed = False

    def hold() -> None:  # about to wait: take (or renew) the waiting lease
        nonlocal held_at
        if time.monotonic() - held_at > s.lease_ttl_s / 3:
            ledger.hold_waiting(job_id, s.lease_ttl_s)
            held_at = time.monotonic()

    try:
        with rt.admission.line.join(ahead) as turn:
            while not rt.stopping.is_set():
                try:
                    if not turn.first():
                        hold()
                        turn.wait(LINE_CHECK_S)
                        continue
                    turn.arm()
                    got = _try_servers(rt, ledger, job_id, spec, queue)
                    if isinstance(got, tuple | str):
                        # start.lua dropped the waiting lease with the claim; a plain claim did not
                        claimed = isinstance(got, tuple) and got[2].slot is not None
                        return got
                    hold()
                except redis.RedisError as exc:
                    log.warning("Redis unavailable while waiting for admission (%s); retrying", exc)
                    rt.stopping.wait(1.0)
                    continue
                if not said and not got:
                    log.warning("no server is ready (%s); waiting", ", ".join(s.server_urls))
                    said = True
                if got:
                    turn.wait(s.admission_wait_s * (0.5 + random.random()))
                else:
                    rt.stopping.wait(s.admission_wait_s)
            return None
    finally:
        if held_at and not claimed:
            with contextlib.suppress(redis.RedisError):
                ledger.hold_waiting(job_id, s.lease_ttl_s, hold=False)


def _try_servers(
    rt: Runtime, ledger: Ledger, job_id: str, spec: dict, queue: str
) -> tuple[ServerView, Slot, Claim] | str | bool:
    """Admitted and claimed on a server; why the job cannot be claimed; or whether any server
    is ready (True: ready but full)."""
    adm = rt.admission
    s = rt.settings
    request = spec["request"]
    tokens = adm.estimate(ledger.run, request)
    views = rt.pool.ready_views()
    if len(views) > 1:
        views.sort(key=lambda v: adm.load(v.name) / (adm.budget(v.capacity) or float("inf")))
    for view in views:
        admit = adm.request(view.name, view.capacity, tokens, queue)
        if admit is None:  # not limited: a plain claim, no slot
            claim = ledger.claim(job_id, rt.worker_id, s.lease_ttl_s)
            slot = Slot(view.name, "", 0)
        else:
            claim = ledger.start(job_id, rt.worker_id, s.lease_ttl_s, admit, spec)
            if claim == "full":
                continue
            slot = Slot(view.name, str(admit.args[0]), tokens)
        if isinstance(claim, str):
            return claim
        return view, slot, claim
    return bool(views)


def _run(rt: Runtime, ledger: Ledger, claim: Claim, url: str, slot: Slot) -> tuple[str, bool]:
    """Stream the claimed job and commit it or settle its error: (what happened, whether the
    admission slot was given back with the commit)."""
    s = rt.settings
    run, job_id = claim.run, claim.job_id
    base = claim.checkpoint if s.continue_partial else Checkpoint()
    state = AttemptState(base=base, progress=Progress())
    tracker = None
    if slot.tokens:
        tracker = rt.admission.tracker(run, claim.spec["request"], base.tokens)
        state.slot_update = tracker.update
    else:
        claim.slot = None
    try:
        outcome = _attempt(rt, claim, url, state)
    except errors.GenerationError as exc:
        failure = exc
        return durable(lambda: _settle(rt, ledger, claim, url, failure, state)), False
    except errors.StaleClaimError as exc:
        log.warning("%s", exc)
        return "stale", False
    outcome.result["server"] = url
    if claim.checkpoint and not s.continue_partial:
        outcome.result["restarted"] = True  # a checkpoint existed; continue_partial is off
    lengths = tracker.finish(outcome.result["usage"]["completion_tokens"]) if tracker else None
    release = claim.slot is not None
    verdict = durable(lambda: ledger.commit(claim, outcome.result, outcome.new_tokens, lengths, release))
    if release:
        rt.admission.released()
    if verdict != "ok":
        log.warning("commit of %s/%s: %s", run, job_id, verdict)
    return ("done" if verdict == "ok" else verdict), release


def _attempt(rt: Runtime, claim: Claim, url: str, state: AttemptState) -> Outcome:
    client = rt.client(url)
    coro = run_attempt(client, claim, rt.settings, rt.watch, state)
    try:
        return rt.loop.run(coro)
    except errors.InvalidRequestError as exc:
        if not state.base:
            raise
        # The server refused to continue the partial: start over, and record that it did.
        log.warning("job %s: continuation refused (%s); starting over", claim.job_id, exc.message)
        state.base, state.progress, state.reported_tokens = Checkpoint(), Progress(), 0
        outcome = rt.loop.run(run_attempt(client, claim, rt.settings, rt.watch, state))
        outcome.result["restarted"] = True
        return outcome


def _settle(
    rt: Runtime, ledger: Ledger, claim: Claim, url: str, exc: errors.GenerationError, state: AttemptState
) -> str:
    s = rt.settings
    err = JobError(exc.error_class, exc.message)
    checkpoint = state.checkpoint()
    if isinstance(exc, errors.AuthError):
        _auth_broken(rt, exc)
        return ledger.release(
            claim, err, delay_s=0, burn=False, max_attempts=s.max_attempts, checkpoint=checkpoint
        )
    if isinstance(exc, errors.TerminalError):
        log.warning("job %s/%s failed: %s: %s", claim.run, claim.job_id, err.error_class, err.message)
        return ledger.fail(claim, err)
    if isinstance(exc, errors.ShutdownError | errors.JobCancelledError):
        return ledger.release(
            claim, err, delay_s=0, burn=False, max_attempts=s.max_attempts, checkpoint=checkpoint
        )
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
    return ledger.release(
        claim,
        err,
        delay_s=s.server_wait_s if down else delay,
        burn=not down,
        max_attempts=s.max_attempts,
        checkpoint=checkpoint,
    )


def _auth_broken(rt: Runtime, exc: errors.AuthError) -> None:
    if rt.auth_error is None:
        rt.auth_error = exc.message
        log.error(
            "the server refused the API key (%s): this worker stops claiming jobs. "
            "Set TOKENMILL_API_KEY to the server's --api-key and restart the worker.",
            exc.message,
        )


def backoff_s(base: float, cap: float, retries: int) -> float:
    """Exponential backoff with full jitter on its upper half."""
    ceiling = min(cap, base * (2**retries))
    return ceiling / 2 + random.random() * ceiling / 2
