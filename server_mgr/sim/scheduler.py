"""The KV-cache scheduler model: a step loop that admits, prefills, decodes and retracts.

Like SGLang's scheduler, each iteration is either a prefill batch (new or retracted requests
whose tokens fit) or one decode step (one token per running request). Running requests hold
``prompt + generated`` tokens in a pool of ``--max-total-tokens``; the pool is never exceeded.
Admission reserves room for future tokens with SGLang's ``new_token_ratio`` (it decays while
decoding goes well and jumps after a retraction). When the pool is full at a decode step, the
newest running requests are retracted to the head of the queue, keeping their generated tokens,
and are re-prefilled (prompt + generated) later.

Step time is ``step_ms + step_ms_per_req * batch``: bigger batches give more throughput until
the KV pool binds. Handlers learn of new tokens through :meth:`SimRequest.wait`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from server_mgr.sim import logs
from server_mgr.sim.config import MAX_PREFILL_TOKENS, SimConfig
from server_mgr.sim.logs import SimLog

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's cap on the per-request reservation
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_DECODE_STEPS = 20


class QueueFullError(Exception):
    """``--max-queued-requests`` is reached: the request is refused with 503."""


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request in the scheduler. ``emitted`` is what handlers may send (stream_interval)."""

    rid: str
    prompt_tokens: int
    output_tokens: int  # tokens it will generate before finishing
    max_new_tokens: int  # the limit SGLang knows (for the reservation), >= output_tokens
    finish_reason: str = "stop"  # given on natural completion ("stop" or "length")
    generated: int = 0
    emitted: int = 0
    state: str = "new"  # new -> waiting -> running -> (waiting ->) finished
    finished: bool = False
    retractions: int = 0
    arrived: float = field(default_factory=time.monotonic)
    _waiter: asyncio.Future[None] | None = None

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    def notify(self) -> None:
        """Wake the handler waiting on this request (cheap; called per emitted chunk)."""
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def wait(self) -> asyncio.Future[None]:
        """A future resolved at the next emission or at finish."""
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter


@dataclass(slots=True)
class Snapshot:
    """Scheduler figures as of the last Prefill/Decode log event (what /metrics shows)."""

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_used_tokens: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    num_retracted_reqs: int = 0


@dataclass(slots=True)
class LoadSnapshot:
    """What ``/v1/loads`` shows: published at every prefill, when idle, and every
    ``--load-snapshot-publish-interval`` decode steps, as SGLang 0.5.23 does."""

    running: int = 0
    waiting: int = 0
    used_tokens: int = 0
    timestamp: float = 0.0


class Scheduler:
    """The step loop and the KV pool accounting."""

    def __init__(self, cfg: SimConfig, log: SimLog) -> None:
        self.cfg = cfg
        self.log = log
        self.capacity = cfg.max_total_tokens
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.used_tokens = 0
        self.peak_used_tokens = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.paused = False  # the stall_streams fault: no step runs while set
        self.retracted_total = 0
        self.generated_total = 0
        self.snapshot = Snapshot()
        self.load = LoadSnapshot(timestamp=time.time())
        self._wake = asyncio.Event()
        self._decode_steps = 0
        self._retracted_since_log = 0
        self._last_decode_log = (time.monotonic(), 0)
        self._last_prefill_log = time.monotonic()

    # --- requests in and out ---------------------------------------------------------------

    def submit(self, req: SimRequest) -> None:
        """Queue ``req``; QueueFullError when ``--max-queued-requests`` is reached."""
        limit = self.cfg.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError("The request queue is full.")
        req.state = "waiting"
        self.waiting.append(req)
        self._wake.set()

    def abort(self, rid: str = "", *, abort_all: bool = False) -> int:
        """Abort requests whose rid starts with ``rid`` (SGLang matches by prefix)."""
        if not rid and not abort_all:
            return 0
        victims = [r for r in (*self.waiting, *self.running) if abort_all or r.rid.startswith(rid)]
        for r in victims:
            self.finish(r, "abort")
        return len(victims)

    def finish(self, req: SimRequest, reason: str) -> None:
        """End ``req`` now (natural end, abort or a handler's fault); frees its KV tokens."""
        if req.finished:
            return
        if req.state == "running":
            self.running.remove(req)
            self.used_tokens -= req.kv_tokens
        elif req.state == "waiting":
            self.waiting.remove(req)
        req.state = "finished"
        req.finished = True
        req.finish_reason = reason
        req.emitted = req.generated
        req.notify()

    def resume(self) -> None:
        """Wake the loop (after the stall fault is lifted)."""
        self._wake.set()

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.capacity

    # --- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        """Step forever: prefill a batch when one can be admitted, else decode one step."""
        while True:
            if self.paused or not (self.running or self.waiting):
                if not self.running:
                    self.new_token_ratio = INIT_NEW_TOKEN_RATIO
                    self.publish_load()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._admit()
            if batch:
                await self._prefill(batch)
            elif self.running:
                await self._decode_step()
            else:
                # nothing fits and nothing runs: only possible transiently; yield to handlers
                await asyncio.sleep(self.cfg.step_ms / 1000)

    def _reserved(self) -> float:
        """Tokens the running requests are expected to still need (SGLang's estimate)."""
        ratio = self.new_token_ratio
        return sum(min(r.max_new_tokens - r.generated, CLIP_MAX_NEW_TOKENS) * ratio for r in self.running)

    def _admit(self) -> list[SimRequest]:
        """Take requests from the head of the queue while their tokens fit (FCFS, no skipping)."""
        room = self.capacity - self.used_tokens - self._reserved()
        batch: list[SimRequest] = []
        extend_total = 0
        while self.waiting and len(self.running) + len(batch) < self.cfg.max_running_requests:
            req = self.waiting[0]
            extend = req.kv_tokens + 1  # the prefill also produces the next token
            reserve = min(req.max_new_tokens - req.generated, CLIP_MAX_NEW_TOKENS)
            first = not batch and not self.running
            hard_room = self.capacity - self.used_tokens - extend_total
            if first:
                # an idle server always admits the head if its tokens fit at all
                if extend > hard_room:
                    break
            elif extend + reserve >= room or extend_total + extend > MAX_PREFILL_TOKENS:
                break
            self.waiting.popleft()
            batch.append(req)
            room -= extend + reserve
            extend_total += extend
        return batch

    async def _prefill(self, batch: list[SimRequest]) -> None:
        cfg = self.cfg
        new_tokens = sum(r.kv_tokens for r in batch)
        for r in batch:
            r.state = "running"
            self.running.append(r)
            self.used_tokens += r.kv_tokens
        self._check_pool()
        self._log_prefill(len(batch), new_tokens)
        self.publish_load()
        await asyncio.sleep((cfg.step_ms + new_tokens / cfg.prefill_tokens_per_ms) / 1000)
        for r in batch:
            if r.state != "running":
                continue  # aborted during the prefill
            if r.output_tokens <= 0:
                self.finish(r, r.finish_reason)
            else:
                self._advance(r)

    async def _decode_step(self) -> None:
        cfg = self.cfg
        if self.capacity - self.used_tokens < len(self.running):
            self._retract()
        start = time.monotonic()
        batch = len(self.running)
        step_s = (cfg.step_ms + cfg.step_ms_per_req * batch) / 1000
        # the CPU time spent writing chunks counts inside the step, as GPU time would
        await asyncio.sleep(max(0.0, start + step_s - time.monotonic()))
        while self.paused:
            self._wake.clear()
            await self._wake.wait()
        for r in list(self.running):
            self._advance(r)
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - RATIO_DECAY)
        self._decode_steps += 1
        if self._decode_steps % cfg.decode_log_interval == 0:
            self._log_decode()
        if self._decode_steps % cfg.load_snapshot_publish_interval == 0:
            self.publish_load()

    def _advance(self, req: SimRequest) -> None:
        """One token for ``req``; emits per stream_interval and finishes at its length."""
        req.generated += 1
        self.used_tokens += 1
        self.generated_total += 1
        if req.generated >= req.output_tokens:
            self.finish(req, req.finish_reason)
        elif req.generated == 1 or req.generated % self.cfg.stream_interval == 0:
            req.emitted = req.generated
            req.notify()
        self._check_pool()

    def _retract(self) -> None:
        """Move the newest running requests back to the head of the queue until a step fits."""
        victims: list[SimRequest] = []
        gained = 0
        while len(self.running) > 1 and self.capacity - self.used_tokens < len(self.running):
            req = self.running.pop()
            self.used_tokens -= req.kv_tokens
            gained += req.kv_tokens
            req.state = "waiting"
            req.retractions += 1
            victims.append(req)
        # oldest first at the head, so that FCFS order is kept
        self.waiting.extendleft(victims)
        old = self.new_token_ratio
        decoded = sum(r.generated for r in self.running)
        max_new = sum(r.max_new_tokens for r in self.running)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / (max_new + 1))
        self.retracted_total += len(victims)
        self._retracted_since_log += len(victims)
        self.log.warning(logs.retract_line(len(victims), gained, old, self.new_token_ratio), rank=True)

    def _check_pool(self) -> None:
        if self.used_tokens > self.peak_used_tokens:
            self.peak_used_tokens = self.used_tokens
        # a broken invariant is a sim bug: fail loudly rather than report a wrong capacity
        assert self.used_tokens <= self.capacity, (self.used_tokens, self.capacity)

    # --- logs and metrics snapshots --------------------------------------------------------

    def _log_prefill(self, new_seq: int, new_tokens: int) -> None:
        now = time.monotonic()
        throughput = new_tokens / max(now - self._last_prefill_log, 1e-3)
        self._last_prefill_log = now
        running = len(self.running) - new_seq
        self.log.info(
            logs.prefill_line(new_seq, new_tokens, self.token_usage, running, len(self.waiting), throughput),
            rank=True,
        )
        self._take_snapshot()

    def _log_decode(self) -> None:
        now = time.monotonic()
        t0, n0 = self._last_decode_log
        throughput = (self.generated_total - n0) / max(now - t0, 1e-3)
        self._last_decode_log = (now, self.generated_total)
        self.snapshot.gen_throughput = throughput
        self.log.info(
            logs.decode_line(
                len(self.running), self.used_tokens, self.token_usage, throughput, len(self.waiting)
            ),
            rank=True,
        )
        self._take_snapshot()
        self._retracted_since_log = 0

    def log_health_probe(self) -> None:
        """An idle /health probe shows as a 1-token prefill, as on the real server."""
        if not self.running and not self.waiting:
            self.log.info(logs.prefill_line(1, 1, self.token_usage, 0, 0, 0.0), rank=True)
            self._take_snapshot()

    def publish_load(self) -> None:
        self.load = LoadSnapshot(len(self.running), len(self.waiting), self.used_tokens, time.time())

    def _take_snapshot(self) -> None:
        s = self.snapshot
        s.num_running_reqs = len(self.running)
        s.num_queue_reqs = len(self.waiting)
        s.num_used_tokens = self.used_tokens
        s.token_usage = round(self.token_usage, 2)
        s.num_retracted_reqs = self._retracted_since_log
