"""Capacity-aware admission: a global limiter in Redis, shared by every worker on every host.

The closed loop: each server has a *window*, the requests tokenmill may have in flight on it,
steered about twice a second by what the server reports (its running and waiting requests, its KV
use, its retractions; the rule is :mod:`workers.admission.policy`) so that a few requests
always wait in the server's own queue and its scheduler, which knows its KV cache best, keeps the
pool full. Requests are counted in the window whatever their size; the server decides which fit.
One worker at a time reads each server (:class:`workers.loadwatch.LoadWatch`).

The guard, while a server has no fresh window (the first seconds of a run, a silent watcher):
each server gets a token budget, ``admission_fraction`` of its ``max_total_num_tokens`` (published
by the server manager, or read from ``/server_info``). A request holds its *projected peak* KV
while it runs: the peak over future lengths x of ``(prompt + x) * P(L >= x | L >= generated)``,
from the run's completion-length survival curve (:mod:`tokenmill.lengths`; before anything has
ended, every request is assumed to reach ``max_tokens``). The hold shrinks as the run's lengths
become known and is recomputed at every heartbeat, so it follows the request as it grows; since
requests that end free their KV, requests started together do not all count at their maximum.
Each queue may use at most ``admission_queue_share`` of the budget (or of the window), so long
prompts cannot starve short ones or the reverse. Slots are leases renewed with the job's lease: a dead
worker's slots expire.

Jobs of one process that wait for room stand in a line (:mod:`workers.admission.waitline`): only the
first asks Redis (at once when this process frees a slot, when a paced start is due, every
``admission_wait_s`` for slots freed elsewhere), so hundreds of waiting jobs cost one poll, not
hundreds, and are served in order.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.admission_view import read_survival
from tokenmill.ledger import Executor
from tokenmill.lengths import Survival, bin_of, reached
from tokenmill.redis_async import LoopRedis
from tokenmill.server_report import Load
from tokenmill.settings import Settings
from tokenmill.tokens import estimate_prompt_tokens
from tokenmill.transitions import AdmitRequest, LengthReport, SlotUpdate
from workers.admission import policy
from workers.admission.waitline import WaitLine

STATS_TTL_S = 1.0  # how stale a process's copy of a run's length curve may be
# ... while fewer than YOUNG_CURVE_ENDED of its requests have ended: each end then moves the
# curve much, and every request admitted meanwhile is sized by the copy for its whole life
YOUNG_CURVE_TTL_S = 0.2
YOUNG_CURVE_ENDED = 32
WINDOW_FRESH_POLLS = 6  # a window older than this many polls is stale: the token guard decides
SMALLEST_WINDOW = 2
BACKOFF_HOLD_S = 5.0  # after a retraction the window holds still this long
LOAD_FIELD = "total"  # the used hash's field: tokens admitted on the server (admit.lua)


@dataclass(frozen=True, slots=True)
class Slot:
    server: str
    member: str
    tokens: int
    shared: int = 0  # tokens of its prompt taken as cached on the server (its prefix's home)


class LengthTracker:
    """One attempt's reports: its hold, the length bins it reached since the last report, and at
    the end its prompt's size as estimated and as the server held it (``prompt_estimate`` 0: not
    reported: a continuation's prompt holds its partial, and a prompt partly taken as cached on
    its server by affinity is netted already)."""

    def __init__(self, held: Callable[[int], int], base_tokens: int, prompt_estimate: int = 0) -> None:
        self._held = held
        # a continued attempt's earlier bins were reported by the attempt before it
        self._reported = base_tokens if base_tokens > 0 else -1
        self._prompt_estimate = prompt_estimate if base_tokens <= 0 else 0

    def update(self, generated: int) -> SlotUpdate:
        """The slot's new size and the bins newly reached (for a heartbeat)."""
        return SlotUpdate(self._held(generated), self._newly_reached(generated))

    def finish(self, completion_tokens: int, usage: dict[str, Any] | None = None) -> LengthReport:
        """The bins still to report and the bin the request ended in (for the commit); with the
        server's ``usage``, the prompt's tokens in its KV pool (its count, less what it reported
        served from its prefix cache)."""
        kv = prompt_kv_tokens(usage) if self._prompt_estimate else 0
        prompt = (self._prompt_estimate, kv) if kv > 0 else None
        return LengthReport(self._newly_reached(completion_tokens), bin_of(completion_tokens), prompt)

    def _newly_reached(self, tokens: int) -> tuple[int, ...]:
        bins = reached(self._reported, tokens)
        self._reported = max(self._reported, tokens)
        return tuple(bins)


def output_tokens(max_tokens: Any, default: int) -> int:
    """The output a request is projected to reach by its ``max_tokens``, within 1 and
    :data:`policy.SLOT_MAX` (``default`` when it is absent or not a positive number: the server
    refuses such a request, and its size must not enter admission's counts meanwhile)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | float) or not max_tokens >= 1:
        return default
    return int(min(max_tokens, policy.SLOT_MAX))


def held_count(raw: bytes | str | None) -> int:
    """A count of the used hash as admission's scripts read it: garbage is 0 (admit.lua heals it)."""
    try:
        return max(0, int(float(raw or 0)))
    except (ValueError, OverflowError):
        return 0


def prompt_kv_tokens(usage: dict[str, Any] | None) -> int:
    """The prompt tokens a request held in the server's KV pool by its ``usage`` (0: unknown):
    ``prompt_tokens`` less ``prompt_tokens_details.cached_tokens`` (SGLang reports the latter with
    ``--enable-cache-report``)."""
    if not usage:
        return 0
    details = usage.get("prompt_tokens_details") or {}
    return max(0, int(usage.get("prompt_tokens") or 0) - int(details.get("cached_tokens") or 0))


class Admission:
    """Take and give back admission slots; estimate what a request will hold."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.r = client
        self.s = settings
        self.ledger = Executor(client)
        self._curves: dict[str, tuple[float, Survival]] = {}
        self.line = WaitLine()
        s = settings
        self.knobs = policy.Knobs(
            queue_target=s.admission_queue_target,
            queue_share=0.1,
            backoff=s.admission_backoff,
            hold_ms=int(BACKOFF_HOLD_S * 1000),
            ceiling=s.admission_usage_ceiling,
            smallest=SMALLEST_WINDOW,
            fresh_ms=int(s.admission_poll_s * WINDOW_FRESH_POLLS * 1000),
            reserve=s.admission_reserve,
            guard=s.admission_fraction,
            group=s.admission_pace_group if s.admission_pacing else 0,
        )

    def budget(self, capacity: int | None) -> int | None:
        return None if not capacity or not self.s.admission else int(capacity * self.s.admission_fraction)

    def held(self, run: str, request: dict[str, Any], generated: int) -> int:
        """What a request that has generated ``generated`` tokens is projected to hold at most."""
        return self.held_on(self.survival(run), request, generated)

    def held_on(self, curve: Survival, request: dict[str, Any], generated: int = 0) -> int:
        """:meth:`held` by the curve given, at most :data:`policy.SLOT_MAX`."""
        max_tokens = output_tokens(request.get("max_tokens"), self.s.admission_default_output_tokens)
        prompt = curve.prompt(estimate_prompt_tokens(request["messages"]))
        return min(policy.SLOT_MAX, curve.hold(prompt, max_tokens, generated))

    def survival(self, run: str) -> Survival:
        """The run's completion-length curve (cached for ``STATS_TTL_S``, ``YOUNG_CURVE_TTL_S``
        while it is young)."""
        curve = self.fresh_survival(run)
        if curve is None:
            curve = read_survival(self.r, run)
            self._curves[run] = (time.monotonic(), curve)
        return curve

    def fresh_survival(self, run: str) -> Survival | None:
        """The run's curve if this process's copy is fresh; None when it would be read from Redis
        (on the event loop, nothing may wait for Redis)."""
        cached = self._curves.get(run)
        if not cached:
            return None
        ttl = STATS_TTL_S if cached[1].ended >= YOUNG_CURVE_ENDED else YOUNG_CURVE_TTL_S
        return cached[1] if time.monotonic() - cached[0] < ttl else None

    def tracker(self, run: str, request: dict[str, Any], base_tokens: int, shared: int = 0) -> LengthTracker:
        """What a running request reports at heartbeats and commit (hold, length bins reached);
        ``shared``: tokens of its prompt already cached on its server, which it holds no more
        of than its siblings do."""
        return LengthTracker(
            lambda generated: max(1, self.held(run, request, generated) - shared),
            base_tokens,
            0 if shared else estimate_prompt_tokens(request["messages"]),
        )

    async def loads(self, client: LoopRedis, servers: Sequence[str]) -> list[int]:
        """Tokens currently admitted on each of ``servers``, on the loop's client (one pipelined
        round trip)."""
        used = [client.call("HGET", keys.admission_used(server), LOAD_FIELD) for server in servers]
        return [held_count(x) for x in await asyncio.gather(*used)]

    def fullness(self, load: int, capacity: int | None) -> float:
        """How full a server is for admission: the tokens admitted on it over its budget (0 when
        it has none); jobs go to the least full server first."""
        return load / (self.budget(capacity) or float("inf"))

    def request(self, server: str, capacity: int | None, tokens: int, queue: str) -> AdmitRequest | None:
        """What ``admit.lua`` (alone, or inside ``start.lua`` with the claim) needs for a slot of
        ``tokens`` on ``server``; None when admission does not limit this server (admission off,
        or no known capacity and no closed loop)."""
        s = self.s
        budget = self.budget(capacity)
        if not s.admission or (budget is None and not s.admission_closed_loop):
            return None
        if budget is None:
            budget = 10**15  # unknown capacity: only a fresh window limits
        other = "long" if queue == "short" else "short"
        return AdmitRequest(
            (keys.admission(server), keys.admission_used(server)),
            [
                uuid.uuid4().hex,
                tokens,
                queue,
                budget,
                int(budget * s.admission_queue_share),
                int(s.lease_ttl_s * 1000),
                other,
                s.admission_queue_share,
                self.knobs.fresh_ms if s.admission_closed_loop else 0,
                self.knobs.group,
            ],
        )

    def adapt(self, server: str, load: Load, retractions: int | None) -> int:
        """Steer ``server``'s window by what it reports now (:func:`policy.steer`); the new window.
        One watcher at a time reads a server; the rule writes only fields of its own."""
        state = self.ledger.call(t.window_state(server, policy.FIELDS))
        seen = -1 if retractions is None else retractions
        decided = policy.steer(load, seen, self.knobs, state.stored, state.slots, state.now_ms)
        self.ledger.call(t.set_window(server, decided.fields))
        if self.s.admission_trace:
            with open(self.s.admission_trace, "ab") as trace:
                trace.write(policy.trace_line(load, seen, self.knobs, state, decided))
        self.wake()  # a wider window: let the head of this process's line ask now
        return decided.window

    def release(self, slot: Slot) -> None:
        if slot.tokens:
            self.ledger.call(t.unadmit(slot.server, slot.member))
            self.wake()

    def wake(self) -> None:
        """Let the head of this process's line ask for room now (from any thread)."""
        self.line.wake_head()
