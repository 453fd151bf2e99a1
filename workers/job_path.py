"""A job's path on the worker's event loop, in one hand-off: peek → wait for admission → admit
and claim → stream → commit.

The task's thread hands the job to the loop and waits once. Run from the thread (as it was
before), the peek, the waiting lease, each ask for room, the claim and the commit each blocked
it on a Redis round trip and handed the GIL back and forth with the loop: about 150-200 µs of a
worker's CPU a round trip (bench/jobcost.py), on top of redis-py's own ~60 µs a command; on the
loop the same scripts cost ~10-25 µs each (:mod:`tokenmill.redis_async`). Jobs waiting for room
stand in this process's line (:class:`~workers.admission.waitline.WaitLine`).

Nothing here blocks the loop: the server and run figures admission decides by are refreshed on
a helper thread when due (about once a second), Redis is ridden out by waiting on the loop
(:func:`~tokenmill.redis_retry.ride_out`), and an attempt that ends in an error goes back to the
task's thread, which settles it on the loop too (:mod:`workers.job`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import TYPE_CHECKING

import redis

from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.quality import LengthBounds
from tokenmill.redis_retry import ride_out
from tokenmill.transitions import Claim, Full, Peek
from tokenmill.url_secrets import redact_url
from workers.admission import affinity
from workers.admission.limiter import Slot
from workers.attempt import Attempted, attempt_job
from workers.pool import ServerView

if TYPE_CHECKING:
    from workers.runtime import Runtime

log = logging.getLogger("tokenmill.worker")
FINAL_STATES = ("done", "failed", "cancelled")
LINE_CHECK_S = 0.5  # how often a job behind the head looks at the stop flag and its lease
WAIT_RETRY_S = 1.0  # after a Redis error while waiting for admission
BOUNDS_EVERY_S = 5.0  # how often a process reads each run's usual completion lengths


async def run_job(rt: Runtime, run: str, job_id: str) -> str | Attempted:
    """Run ``job_id`` on the loop. Returns what happened (as :func:`workers.job.run_job` does),
    or an attempt that ended in an error, for the task's thread to settle."""
    led, k = rt.async_ledger, keys.RunKeys(run)
    peeked = await ride_out(lambda: led.call(t.peek(k, job_id)), rt.abort_streams)
    if peeked is None:
        return "missing"
    if peeked.state in FINAL_STATES:
        return peeked.state
    s = rt.settings
    # the job's prefix key, once per delivery (None: affinity off, or no second server to choose)
    several = s.server_affinity and len(s.server_urls) > 1
    prefix = affinity.prefix(peeked.spec["request"], long_system=s.admission) if several else None
    prefills = rt.prefills if s.server_prefill_wait_s > 0 else None
    aff = affinity.JobAffinity.of(prefix, rt.homes, s.server_affinity_wait_s, prefills)
    try:
        started = await _admit(rt, k, job_id, peeked, aff)
        if started is None:
            return "stopping"
        if isinstance(started, str):
            if started == "paused":
                await _paused(rt, k)
            else:
                log.info("job %s/%s not claimed: %s", run, job_id, started)
            return started
        server, slot, claim = started
        done = await attempt_job(rt, claim, server.url, slot, on_first=aff.first_token)
    finally:
        aff.ended()  # with or without a first token: its siblings wait for it no longer
    if done.error is not None:
        return done
    commit = done.commit(rt.settings, await _length_bounds(rt, k) if rt.settings.quality_signals else None)
    verdict = await ride_out(lambda: led.call(t.commit(k, done.claim, *commit)), rt.abort_streams)
    if done.claim.slot is not None:
        rt.admission.wake()  # the commit (finish.lua) gave the slot back: let this process's line ask
    if verdict != "ok":
        log.warning("commit of %s/%s: %s", run, job_id, verdict)
        return verdict
    await rt.reference.after_commit(led, done, commit)  # a dict lookup without a reference
    return "done"


async def _length_bounds(rt: Runtime, k: keys.RunKeys) -> LengthBounds | None:
    """The run's usual completion lengths (:class:`~tokenmill.quality.LengthBounds`), read from
    its outputs histogram at most every ``BOUNDS_EVERY_S`` by this process (never a read per job;
    a failed read keeps the last)."""
    now = asyncio.get_running_loop().time()
    at, bounds = rt.length_bounds.get(k.run, (-BOUNDS_EVERY_S, None))
    if now - at >= BOUNDS_EVERY_S:
        rt.length_bounds[k.run] = (now, bounds)  # the jobs committing meanwhile do not read too
        with contextlib.suppress(redis.RedisError):
            histogram = await rt.async_ledger.call(t.completion_histogram(k))
            bounds = LengthBounds.from_histogram(histogram)
            rt.length_bounds[k.run] = (now, bounds)
    return bounds


async def _paused(rt: Runtime, k: keys.RunKeys) -> None:
    """Say once per pause that the run is paused: its jobs stay queued, their messages acked."""
    with contextlib.suppress(redis.RedisError):
        pause = await rt.async_ledger.call(t.paused(k))
        if pause is not None and rt.pauses_said.get(k.run) != pause[1]:
            rt.pauses_said[k.run] = pause[1]
            log.warning(
                "run %s is paused (%s): its jobs stay queued; `tokenmill resume --run %s` lifts it",
                k.run, pause[0], k.run,
            )  # fmt: skip


async def _admit(
    rt: Runtime, k: keys.RunKeys, job_id: str, peeked: Peek, aff: affinity.JobAffinity
) -> tuple[ServerView, Slot, Claim] | str | None:
    """Wait in this process's line for a ready server with room, and claim the job with the slot
    in the same round trip (``start.lua``). Returns the server, the slot and the claim; why the
    job could not be claimed (nothing admitted); or None when the worker stops first.

    Only the head of the line asks Redis for room, at once when a slot is freed in this process,
    when a paced server's next start is due (:class:`tokenmill.transitions.Full`), and every
    ``admission_wait_s`` for slots freed elsewhere. While it waits the job holds a
    waiting lease, so that if this worker dies the job is republished at once instead of when
    the broker's visibility timeout restores the message; a job admitted at once never needs
    one, and the claim drops it (no Redis call of its own).

    A job whose sibling (same prefix key) this process is sending first waits, before it
    joins the line, for that sibling's first token (:data:`workers.admission.affinity.Prefills`)."""
    s = rt.settings
    said = False
    held_at = 0.0
    claimed = False
    loop = asyncio.get_running_loop()

    async def hold() -> None:  # about to wait: take (or renew) the waiting lease
        nonlocal held_at
        if loop.time() - held_at > s.lease_ttl_s / 3:
            await rt.async_ledger.call(t.wait(k, job_id, s.lease_ttl_s))
            held_at = loop.time()

    try:
        sibling = aff.sibling_prefill(loop.time())
        if sibling is not None:
            await hold()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sibling.wait(), s.server_prefill_wait_s)
        async with rt.admission.line.join(ahead=peeked.attempts > 0) as turn:
            while not rt.stopping.is_set():
                try:
                    if not turn.first():
                        await hold()
                        await turn.wait(LINE_CHECK_S)
                        continue
                    turn.arm()
                    got = await _try_servers(rt, k, job_id, peeked, aff)
                    if isinstance(got, tuple):
                        aff.admitted(got[0].name, loop.time())
                    if isinstance(got, tuple | str):
                        # start.lua dropped the waiting lease with the claim; a plain claim did not
                        claimed = isinstance(got, tuple) and got[2].slot is not None
                        return got
                    await hold()
                    if got is not None and aff.for_home and turn.step_back():
                        continue  # waiting for its home only: the jobs behind it may go elsewhere
                except redis.RedisError as exc:
                    log.warning("Redis unavailable while waiting for admission (%s); retrying", exc)
                    await asyncio.sleep(WAIT_RETRY_S)
                    continue
                if not said and got is None:
                    log.warning("no server is ready (%s); waiting", ", ".join(map(redact_url, s.server_urls)))
                    said = True
                await turn.wait(s.admission_wait_s if got is None else got)
            return None
    finally:
        if held_at and not claimed:
            with contextlib.suppress(redis.RedisError):
                await rt.async_ledger.call(t.wait(k, job_id, s.lease_ttl_s, hold=False))


async def _try_servers(
    rt: Runtime, k: keys.RunKeys, job_id: str, peeked: Peek, aff: affinity.JobAffinity
) -> tuple[ServerView, Slot, Claim] | str | float | None:
    """Admitted and claimed on a ready server: the one a sibling went to, or the one the job's
    prefix key prefers, else the least full (:func:`workers.admission.affinity.dispatch_order`; no key:
    least full first); why the job cannot be claimed; when a server is ready but full (or left
    out for the job's prefix: its siblings' server, a cold one), how long to wait before asking
    again (``admission_wait_s``, jittered, or sooner when a paced server's next start is due
    sooner); None when no server is ready."""
    adm, s, led = rt.admission, rt.settings, rt.async_ledger
    views = rt.pool.ready_views_now()
    if views is None:  # due for a refresh: read Redis (and maybe a server) off the loop
        views = await asyncio.to_thread(rt.pool.ready_views)
    curve = adm.fresh_survival(k.run)
    if curve is None:
        curve = await asyncio.to_thread(adm.survival, k.run)
    tokens = adm.held_on(curve, peeked.spec["request"])
    home, aff.for_home = None, False
    retry_s = s.admission_wait_s * (0.5 + random.random()) if views else None
    if len(views) > 1:
        names = [v.name for v in views]
        loads = await adm.loads(led.r, names)
        fullness = [adm.fullness(load, v.capacity) for load, v in zip(loads, views, strict=True)]
        home, only_home = aff.home(asyncio.get_running_loop().time())
        order = affinity.dispatch_order(aff.key, names, fullness, home, aff.cold())
        views = [views[i] for i in order]
        if only_home and views and views[0].name == home:  # waiting for its siblings' server
            views = views[:1]
        aff.for_home = len(views) < len(names)  # refused, it waits for the servers left out
    for view in views:
        # at its home a sibling's shared prefix is cached: it holds only the rest of the KV
        shared = min(aff.shared, tokens - 1) if view.name == home else 0
        admit = adm.request(view.name, view.capacity, tokens - shared, peeked.queue)
        claim: Claim | Full | str
        if admit is None:  # not limited: a plain claim, no slot
            claim = await led.call(t.claim(k, job_id, rt.worker_id, s.lease_ttl_s))
            slot = Slot(view.name, "", 0)
        else:
            claim = await led.call(t.start(k, job_id, rt.worker_id, s.lease_ttl_s, admit, peeked.spec))
            if isinstance(claim, Full):
                if claim.paced_s and retry_s is not None:
                    retry_s = min(retry_s, claim.paced_s)
                continue
            slot = Slot(view.name, str(admit.args[0]), tokens - shared, shared)
        if isinstance(claim, str):
            return claim
        return view, slot, claim
    return retry_s
