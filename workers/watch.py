"""One watchdog for all of a worker process's streams, on its event loop.

Once a second it looks at every stream in flight: it enforces the request's deadlines (first
token, stall, total) and the shutdown, and it sends the heartbeats that are due (a lease
renewed every third of its TTL; the partial text checkpointed every N tokens or S seconds) in
one pipeline to Redis. The heartbeat's reply also carries a stale claim and ``cancel --now``:
the watch then stops that stream, as it stops the streams a server restarted or replaced no longer
holds (:mod:`workers.lost`). The per-chunk path never touches Redis, and a job adds no
task or timer of its own: a watchdog per stream cost a task, a ``wait_for`` and a shielded
future every second, and a heartbeat round trip each.

A heartbeat that hangs (Redis paused) holds back only the next heartbeats of the streams it
carries; every stream's deadlines are still checked every second.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from tokenmill import errors
from tokenmill import transitions as t
from tokenmill.ledger_async import AsyncLedger
from tokenmill.settings import Settings
from tokenmill.transitions import CANCEL_NOW, Beat, Checkpoint, Claim, SlotUpdate
from workers.lost import QUIET_S, Heard, LostStreams
from workers.stream import Progress

log = logging.getLogger("tokenmill.worker")
WATCH_PERIOD_S = 1.0
DROP_WAIT_S = 5.0  # how long a finished stream waits for its heartbeat in flight
LOST = f"and the server held no request for {QUIET_S:g}s: it was restarted or replaced"


@dataclass(slots=True)
class AttemptState:
    """Shared between the stream and the watch; also what a release checkpoints."""

    base: Checkpoint
    progress: Progress
    reported_tokens: int = 0
    # generated tokens -> the admission slot's new size and the length bins reached
    slot_update: Callable[[int], SlotUpdate] | None = None

    def checkpoint(self) -> Checkpoint:
        p = self.progress
        return Checkpoint(
            content=self.base.content + "".join(p.content),
            reasoning=self.base.reasoning + "".join(p.reasoning),
            tokens=self.base.tokens + p.tokens,
            prompt_tokens=self.prompt_tokens(),
        )

    def prompt_tokens(self) -> int:
        """The original prompt's size. A continuation's prompt also holds the partial, whose
        tokens need not be the ones generated (the text is tokenized again), so the size seen
        by the first attempt travels with the checkpoint; an older checkpoint without it falls
        back to the continuation's prompt less the partial's generated tokens."""
        seen = int((self.progress.usage or {}).get("prompt_tokens") or 0)
        if not self.base:
            return seen
        return self.base.prompt_tokens or max(0, seen - self.base.tokens)


@dataclass(slots=True, eq=False)
class Watched:
    """One stream under the watch."""

    claim: Claim
    state: AttemptState
    stream: asyncio.Future[Progress]
    started: float
    server: str  # the root URL it streams from
    last_renew: float
    last_ckpt_at: float
    last_ckpt_tokens: int = 0
    error: errors.TokenmillError | None = None  # why the watch stopped the stream
    beat: asyncio.Future[None] | None = field(default=None, repr=False)  # its heartbeat in flight


class Watch:
    """The process's watchdog; its task starts with the first stream."""

    def __init__(
        self,
        settings: Settings,
        ledger: AsyncLedger,  # the heartbeats' executor
        stopping: threading.Event,
        found_down: Callable[[str], bool] = lambda server: False,
        client: redis.Redis | None = None,  # shares what it finds of the servers (workers.lost)
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.stopping = stopping  # the shutdown's grace is over: checkpoint and release
        self.found_down = found_down  # a server failed its health check (workers.pool)
        self.lost: LostStreams[Watched] = LostStreams(settings.api_key, client)  # restarted or replaced
        self.watched: set[Watched] = set()
        self._task: asyncio.Task[None] | None = None

    def add(
        self, claim: Claim, state: AttemptState, stream: asyncio.Future[Progress], started: float, server: str
    ) -> Watched:
        w = Watched(claim, state, stream, started, server, last_renew=started, last_ckpt_at=started)
        self.watched.add(w)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        return w

    async def drop(self, w: Watched) -> None:
        """Stop watching ``w``; first let its heartbeat in flight land, so that the tokens it
        reported are not counted again by the commit."""
        self.watched.discard(w)
        if w.beat is not None and not w.beat.done():
            await asyncio.wait((w.beat,), timeout=DROP_WAIT_S)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            try:
                self.tick(asyncio.get_running_loop().time())
            except Exception:  # one bad stream must not blind the watch for all of them
                log.exception("the stream watchdog's tick failed")

    def tick(self, now: float) -> None:
        """Check every stream's deadlines; send the heartbeats that are due, in one batch."""
        s = self.settings
        batch: list[tuple[Watched, Beat, int | None]] = []
        heard: dict[str, list[Heard[Watched]]] = {}
        for w in list(self.watched):  # stop() drops from the set
            if w.stream.done():
                continue
            p = w.state.progress
            down = self.found_down(w.server)
            problem = _deadline_problem(s, p, now, w.started, self.stopping, down)
            if problem is not None:
                self.stop(w, problem)
                continue
            heard.setdefault(w.server, []).append(
                Heard(w, p.last_chunk_at or w.started, bool(p.first_chunk_at))
            )
            if w.beat is not None:
                continue
            try:
                due = self._due(w, now)
            except redis.RedisError as exc:  # the slot's size reads the run's length curve
                log.warning("job %s: heartbeat not sent (%s); will retry", w.claim.job_id, exc)
                continue
            if due is not None:
                batch.append((w, *due))
        for w in self.lost.check(now, heard):
            silent = now - (w.state.progress.last_chunk_at or w.started)
            self.stop(w, errors.StreamLostError(f"nothing received for {silent:.0f}s, {LOST}"))
        batch = [due for due in batch if due[0] in self.watched]
        if batch:
            task = asyncio.ensure_future(self._beat(batch, now))
            for w, _, _ in batch:
                w.beat = task

    def _due(self, w: Watched, now: float) -> tuple[Beat, int | None] | None:
        """The heartbeat ``w`` is due, if any, and the tokens its checkpoint holds (None: no
        checkpoint)."""
        s, state = self.settings, w.state
        tokens = state.progress.tokens
        due_ckpt = tokens > w.last_ckpt_tokens and (
            tokens - w.last_ckpt_tokens >= s.checkpoint_every_tokens
            or now - w.last_ckpt_at >= s.checkpoint_every_s
        )
        if not due_ckpt and now - w.last_renew < s.lease_ttl_s / 3:
            return None
        total = state.base.tokens + tokens
        new = max(0, tokens - state.reported_tokens)
        held = state.slot_update(total) if state.slot_update else None
        ck = state.checkpoint() if due_ckpt else None
        return Beat(w.claim, ck, new, held), tokens if due_ckpt else None

    async def _beat(self, batch: list[tuple[Watched, Beat, int | None]], now: float) -> None:
        try:
            ttl = self.settings.lease_ttl_s
            replies = await self.ledger.calls([t.heartbeat(b, ttl) for _, b, _ in batch])
        except redis.RedisError as exc:
            # Redis is restarting or paused: keep streaming; the next tick tries again.
            log.warning("heartbeat of %d job(s) failed (%s); will retry", len(batch), exc)
            return
        finally:
            for w, _, _ in batch:
                w.beat = None
        for (w, beat, ckpt_tokens), reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                log.warning("job %s: heartbeat failed (%s); will retry", w.claim.job_id, reply)
                continue
            if not reply:
                self.stop(w, errors.StaleClaimError(f"job {w.claim.job_id}: the lease was taken over"))
                continue
            w.state.reported_tokens += beat.new_tokens
            w.last_renew = now
            if ckpt_tokens is not None:
                w.last_ckpt_at, w.last_ckpt_tokens = now, ckpt_tokens
            if reply == CANCEL_NOW:
                self.stop(w, errors.JobCancelledError("cancelled (cancel --now); checkpointed"))

    def stop(self, w: Watched, why: errors.TokenmillError) -> None:
        """Cut ``w``'s stream; its attempt raises ``why``."""
        if w in self.watched and not w.stream.done():
            w.error = why
            w.stream.cancel()
        self.watched.discard(w)


def _deadline_problem(
    s: Settings, p: Progress, now: float, started: float, stopping: threading.Event, down: bool
) -> errors.GenerationError | None:
    """Why the stream is to be cut now, if it is. ``down``: its server failed its health check
    (its host vanished with the connection left open, or it wedged); a request that received
    nothing for ``stall_timeout_s`` (no first token; unstreamed, no answer) is then cut, where it
    would otherwise wait out ``first_token_timeout_s`` (unstreamed, ``total_timeout_s``)."""
    if stopping.is_set():
        return errors.ShutdownError("the worker is shutting down; checkpointed and released")
    if now - started > s.total_timeout_s:
        return errors.RequestTimeoutError(f"the request ran past total_timeout_s={s.total_timeout_s}")
    if down and not p.first_chunk_at and now - started > s.stall_timeout_s:
        what = "no answer" if p.whole else "no first token"
        return errors.StreamStalledError(
            f"{what} in {now - started:.0f}s, and the server fails its health check"
        )
    if p.whole:
        return None  # an unstreamed answer sends nothing before the end: only its total deadline
    if not p.first_chunk_at:
        if now - started > s.first_token_timeout_s:
            return errors.StreamStalledError(
                f"no first token within first_token_timeout_s={s.first_token_timeout_s}"
            )
    elif now - p.last_chunk_at > s.stall_timeout_s:
        return errors.StreamStalledError(f"no chunk for stall_timeout_s={s.stall_timeout_s}")
    return None
