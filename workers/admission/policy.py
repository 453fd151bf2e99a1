"""Admission's window rule: how many requests tokenmill may have in flight on a server.

A pure function, :func:`steer`, from what the server reports (running, waiting, KV used and
capacity, retractions so far) and what the ledger counts on it (the used hash admit.lua and
unadmit.lua keep, and its slots' start times and projected peaks) to the new window and the
fields it stamps. The load watch calls it about twice a second per server (one watcher at a time)
through :meth:`workers.admission.limiter.Admission.adapt`; admit.lua compares the window against
what is in flight, atomically. The figures lag the server (SGLang 0.5.23 publishes them every 15
decode steps), so every rule is safe to apply twice to the same figures. In order:

1. **Back off.** The server retracted requests since the last figures (its KV pool overflowed):
   the window shrinks to ``backoff`` of what is on the server, but not below the requests that fit
   below the ceiling at their projected peaks (``total`` / ``n``: those do not overflow the pool
   even all at their peaks at once), and holds still for ``hold_ms``; retractions during the hold
   come from the same overflow and are only noted.
2. **A queue.** The server's own queue is deeper than the target (``queue_target``, or
   ``queue_share`` of its running requests) in these figures and the last ones (a burst of
   arrivals the scheduler has not taken in yet shows once): the window shrinks to running +
   target.
3. **Grow.** Nothing waits on the server, its KV use is below the ceiling, and the window is what
   limits tokenmill (a request was refused since the last figures): the window grows by half the
   requests that would fit below the ceiling beyond the window (or beyond those in flight, if
   more), each sized at its present mean use plus ``reserve`` of the growth projected beyond it,
   never smaller than the highest mean use seen while at least half the window ran (``seen_each``)
   nor than that plus its rise since the figures before (``seen_rise``, capped by the mean
   projected peak). Both start again a lifetime later while outputs end at different lengths
   (what was seen a lifetime ago was held by requests that have ended). Until as many requests
   ended under the window as half of those in flight (a cold start's first batch, which started
   together and peaks together), each is sized at its whole projected peak below the guard's
   budget (``guard`` of the pool). Once outputs are seen to end at different lengths (two or more
   known, not of one length), the requests in flight will not peak together: neither the cold
   batch's whole peak nor the rise sizes a request, and the window takes all the room at once.
3'. **Paced** (the pool binds and outputs are of one length; admit.lua then starts requests
   spread over a lifetime) and every request in flight started paced: instead of rule 3, the
   window becomes as many as fit below the ceiling, less room for a group's growth from young to
   peak, at what a request holds on average over its lifetime (halfway between its young size and
   its projected peak, or the mean use over time, or the present mean use, whichever is most);
   after a retraction of paced requests, never past one fewer than were in flight then
   (``paced_cap``).

The window never goes below ``smallest``. The first figures (or the first after the window went
stale) start it at what is in flight and at least at what the guard lets in at the projected peak,
and let rule 3 apply at once; with nothing in flight they start no window and the guard keeps
deciding. Alongside, :func:`young_fit` fits the size a request holds when it starts (admit.lua
projects the run's tail from it).

Every stored figure is read as admit.lua's prelude reads it (:func:`num`): garbage is the field's
default, a stamp from the future is now.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tokenmill.server_report import Load
from tokenmill.transitions import WindowState

INT_MAX = 2**53 - 1  # prelude.lua's: the largest integer a double holds exactly
# The most tokens a slot holds (prelude.lua's): admission's scripts count in Lua numbers (doubles),
# exact integers only up to 2**53, and a server's counts sum its slots. A job asking for more
# (``max_tokens`` 2**64 - 1) holds this, as if it filled any pool, until its server refuses it.
SLOT_MAX = 2**40

# The used hash's fields the rule reads (tokenmill.transitions.window_state fetches them).
FIELDS = (
    "n window srv_retractions hold_until refused refused_seen srv_waiting total window_ms seen_each "
    "admitted start_admitted start_n srv_running srv_used seen_rise life_ms life_dev use_sum use_n "
    "unpaced use_min paced_cap bound seen_ms len_mean len_dev len_n backoffs"
).split()
# ... those it learns afresh when a window starts
RELEARNED = "seen_each seen_rise seen_ms use_sum use_n use_min paced_cap bound".split()


@dataclass(frozen=True, slots=True)
class Knobs:
    """The rule's settings (from :class:`tokenmill.settings.Settings`)."""

    queue_target: float  # requests to keep waiting on the server ...
    queue_share: float  # ... or this share of its running requests, if more
    backoff: float  # the window after a retraction, of what is on the server
    hold_ms: float  # how long the window holds still after a backoff
    ceiling: float  # the share of the pool the window grows below
    smallest: int
    fresh_ms: float  # how long a window stays fresh (admit.lua's freshness)
    reserve: float  # the share of the projected growth a request is sized by
    guard: float  # the guard's budget, a share of the pool
    group: int  # the pacing group (0: not paced)


@dataclass(frozen=True, slots=True)
class Steer:
    """The new window and the fields of the used hash to set."""

    window: int
    fields: dict[str, float]


def num(v: Any, default: float, lo: float = -INT_MAX, hi: float = INT_MAX) -> float:
    """``v`` as a number within [lo, hi]; ``default`` when absent, not a number, or NaN."""
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        x = default
    if x != x:
        x = default
    return lo if x < lo else hi if x > hi else x


def whole(v: Any, default: float, lo: float = -INT_MAX, hi: float = INT_MAX) -> int:
    return math.floor(num(v, default, lo, hi))


def steer(
    load: Load,
    retractions: float,
    k: Knobs,
    stored: Mapping[str, Any],
    slots: Sequence[tuple[Any, Any]],
    now_ms: int,
) -> Steer:
    """The window by these figures (see the module's docstring): what the server reports now
    (``retractions`` -1: it does not say); ``stored`` is the used hash's :data:`FIELDS`,
    ``slots`` each slot's (start ms, projected peak)."""
    f = dict(stored)
    running, waiting = num(load.running, 0, 0), num(load.waiting, 0, 0)
    used, capacity = num(load.used_tokens, 0, 0), num(load.capacity, 0, 0)
    retractions = num(retractions, -1, -1)
    seen_by = {"srv_running": running, "srv_waiting": waiting, "srv_used": used, "srv_cap": capacity}
    seen_by["srv_retractions"] = retractions
    smallest = whole(k.smallest, 1, 1)
    n, window = whole(f.get("n"), 0, 0), whole(f.get("window"), 0, 0)
    first = window <= 0 or now_ms - num(f.get("window_ms"), 0, 0, now_ms) > num(k.fresh_ms, 0, 0)
    if first and n == 0:
        # nothing in flight to start a window from: the guard decides until something is (a window
        # started at the smallest would hold back a cold start the guard lets in at once)
        return Steer(smallest, {**seen_by, "young_fit": -1})
    refused, admitted = whole(f.get("refused"), 0, 0), whole(f.get("admitted"), 0, 0)
    limiting = refused > whole(f.get("refused_seen"), 0, 0)
    if first:  # from what is in flight, free to grow at once; what was learned starts again
        window, limiting = max(smallest, n), True
        f.update(dict.fromkeys(RELEARNED), start_admitted=admitted, start_n=n)
    # requests ended since the window started: those in flight then plus those admitted since,
    # less those in flight now (a slot given back, or expired)
    ended = whole(f.get("start_n"), 0, 0) + admitted - whole(f.get("start_admitted"), 0, 0) - n
    # absent, the counts start from now
    start_admitted = admitted if f.get("start_admitted") is None else whole(f["start_admitted"], 0, 0)
    start_n = n if f.get("start_n") is None else whole(f["start_n"], 0, 0)
    group, life = whole(k.group, 0, 0), num(f.get("life_ms"), 0, 0)
    alike = one_length(f, life)
    guard = num(k.guard, 1, 0) * capacity
    ceiling = num(k.ceiling, 1, 0) * capacity
    present = used / running if running > 0 else 0.0  # the running requests' mean use now
    peak = num(f.get("total"), 0, 0) / n if n > 0 else 0.0  # those in flight's mean projected peak
    if first and peak > 0:
        # at least as many as the guard lets in at that size: it may not have had them asking yet
        window = max(window, math.floor(min(ceiling, guard) / peak))
    # pacing is for a pool that binds: one more request at its projected peak would not have fit
    # the guard's budget since the window started; on a roomy pool it would only delay starts
    bound = f.get("bound") in ("1", b"1") or (peak > 0 and (n + 1) * peak > guard)
    paced = group > 0 and alike and bound
    learned = learn(f, running, present, window, life if not alike else 0, now_ms)
    out: dict[str, float] = {**seen_by, **learned, "refused_seen": refused}
    out |= {"start_admitted": start_admitted, "start_n": start_n, "bound": int(bound)}
    # outputs seen to end at different lengths (a deviation is known from two): those in flight
    # end apart and do not peak together (a mean stored without a count is an old one, unadmit.lua)
    mixed = num(f.get("len_mean"), 0, 0) > 0 and num(f.get("len_n"), 11) >= 2 and not alike
    held_each = max(learned["seen_each"], 0 if mixed else min(learned["seen_rise"], peak))
    hold_ms = num(k.hold_ms, 0, 0)
    holding = now_ms < num(f.get("hold_until"), 0, 0, now_ms + hold_ms)
    target = whole(max(num(k.queue_target, 0, 0), math.ceil(running * num(k.queue_share, 0, 0, 1))), 0, 0)
    seen_retractions = num(f.get("srv_retractions"), -1, -1)
    paced_cap = whole(f.get("paced_cap"), 0, 0)
    if 0 <= seen_retractions < retractions:
        if not holding:
            backed = math.floor(min(window, running + waiting) * num(k.backoff, 0, 0, 1))
            if peak > 0:
                backed = max(backed, min(window, math.floor(ceiling / peak)))
            if paced:
                # a retraction of paced requests: that many, at the stages they were at, overflow the
                # pool; pacing may take the window back up to one fewer than were in flight (another
                # retraction: one fewer again), not keep it where it backed off to for the run
                cap = max(smallest, min(window, n) - 1)
                paced_cap = min(cap, paced_cap) if paced_cap > 0 else cap
            window = backed
            out |= {"hold_until": now_ms + hold_ms, "backoffs": whole(f.get("backoffs"), 0, 0) + 1}
    elif not holding:
        if waiting > target and num(f.get("srv_waiting"), 0, 0) > target:
            window = min(window, math.floor(running + target))
        elif paced and whole(f.get("unpaced"), 0, 0) <= 0:
            fit = paced_fit(learned, present, peak, num(f.get("len_mean"), 0, 0), group, ceiling)
            if waiting <= target and used < ceiling and fit is not None:
                window = min(fit, paced_cap) if paced_cap > 0 else fit  # since a retraction, no more
        elif waiting == 0 and limiting and capacity > 0 and used < ceiling:
            # present use plus `reserve` of the growth projected beyond it, at least the highest
            # seen; until as many requests ended as half of those in flight, most of those in flight
            # may have started together (a cold start's first batch) and will peak together,
            # unless their outputs end apart
            cold = ended * 2 < n and not mixed
            share, limit = (1.0, min(ceiling, guard)) if cold else (num(k.reserve, 1, 0), ceiling)
            each = max(held_each, present + share * max(0.0, peak - present))
            if each > 0:  # half of what still fits at that size (at least one, if any fits; all
                # of it where outputs end apart)
                room = math.floor(limit / each) - max(n, window)
                if room > 0:
                    window += room if mixed else max(1, math.floor(room / 2))
            else:  # nothing to size a request by yet
                window += target
    window = whole(window, smallest, smallest)
    out |= {"window": window, "window_ms": now_ms, "paced_cap": paced_cap}
    out |= {"pace_ms": math.floor(life / window) if paced else 0}
    out["young_fit"] = young_fit(slots, life, running, used, now_ms)
    return Steer(window, out)


def one_length(f: Mapping[str, Any], life: float) -> bool:
    """Outputs of one length: their moving mean deviation (unadmit.lua) under an eighth of their
    moving mean; until one is known, lifetimes alike in the same way (admit.lua decides so)."""
    length = num(f.get("len_mean"), 0, 0)
    if length > 0:
        return num(f.get("len_dev"), 0, 0) * 8 < length
    return life > 0 and num(f.get("life_dev"), 0, 0) * 8 < life


def learn(
    f: Mapping[str, Any], running: float, present: float, window: int, forget_ms: float, now_ms: int
) -> dict[str, float]:
    """What the requests were seen to hold: the highest mean use (and its rise) and the mean over
    time and the least, taken only while most of the window runs (a few stragglers alone say
    nothing of requests together); the highest starts again once ``forget_ms`` old (0: never)."""
    seen, seen_rise = num(f.get("seen_each"), 0, 0), num(f.get("seen_rise"), 0, 0)
    seen_ms = num(f.get("seen_ms"), now_ms, 0, now_ms)
    use_sum, use_n, use_min = (num(f.get(name), 0, 0) for name in ("use_sum", "use_n", "use_min"))
    # outputs that end at different lengths desynchronise by themselves: the highest mean use
    # seen, once it is a lifetime old, was held by requests that have ended (a cold start's first
    # batch, which started together), not by those in flight, and starts again
    if forget_ms > 0 and now_ms - seen_ms > forget_ms:
        seen, seen_rise, seen_ms = 0.0, 0.0, now_ms
    if running * 2 >= window:
        if present >= seen:
            seen, seen_ms = present, now_ms
        # figures come every poll, and requests that peak together may end before the next: what
        # they hold by then is taken as what they hold now plus the rise since the last figures
        last_running, last_used = num(f.get("srv_running"), 0, 0), num(f.get("srv_used"), 0, 0)
        rise = max(0.0, present - last_used / last_running) if last_running > 0 else 0.0
        seen_rise = max(seen_rise, present + rise)
        use_sum, use_n = use_sum + present, use_n + 1
        if use_min <= 0 or present < use_min:
            use_min = present
    return {
        "seen_each": seen,
        "seen_rise": seen_rise,
        "seen_ms": seen_ms,
        "use_sum": use_sum,
        "use_n": use_n,
        "use_min": use_min,
    }


def paced_fit(
    learned: Mapping[str, float], present: float, peak: float, length: float, group: int, ceiling: float
) -> int | None:
    """Rule 3': as many paced requests as fit below the ceiling (None: nothing sizes one yet).
    Spread over their lifetimes, they hold about their mean use over time, as those ending make
    room for those growing. Outputs of one length grow linearly: on average over a lifetime a
    request holds halfway between its young size (the least mean use seen, or its peak less the
    outputs' mean length once one is known, whichever is more) and its projected peak. Started a
    group at a time and evenly spread, they would hold at most a group's half growth more than
    that; they spread less evenly (lifetimes move with the batch, the tail starts together), so
    room is kept for a group's whole growth (for a group at its peak until a young size is known)."""
    use_n = learned["use_n"]
    each = max(present, learned["use_sum"] / use_n if use_n > 0 else 0.0)
    young, uneven = learned["use_min"], group * peak
    if length > 0:
        young = max(young, peak - length)
    if young > 0:
        young = min(young, peak)
        each = max(each, (young + peak) / 2)
        uneven = group * (peak - young)
    if each <= 0 or peak <= 0:
        return None
    return math.floor((ceiling - uneven) / each)


def young_fit(
    slots: Sequence[tuple[Any, Any]], life: float, running: float, used: float, now_ms: int
) -> float:
    """What a request holds when it starts, as the server's figures show it: the size that makes
    the requests in flight, each grown linearly from it to its projected peak over a lifetime,
    hold what the server reports now (-1: not known)."""
    if life <= 0 or running <= 0:
        return -1
    held_at_peak = young_share = 0.0
    for at, tokens in slots:
        grown = min(1.0, max(0.0, now_ms - num(at, now_ms)) / life)
        held_at_peak += num(tokens, 0, 0, SLOT_MAX) * grown
        young_share += 1 - grown
    return max(0.0, (used - held_at_peak) / young_share) if young_share > 0 else -1


def trace_line(load: Load, retractions: float, k: Knobs, state: WindowState, decided: Steer) -> bytes:
    """One decision as a JSON line (``admission_trace``): what :func:`replay` takes."""
    stored = {n: None if v is None else v.decode() for n, v in state.stored.items()}
    slots = [[at.decode(), tokens.decode()] for at, tokens in state.slots]
    seen: dict[str, Any] = {"report": [*load, retractions], "knobs": dataclasses.asdict(k)}
    seen |= {"stored": stored, "slots": slots, "now_ms": state.now_ms}
    return orjson.dumps({**seen, "window": decided.window, "fields": decided.fields}) + b"\n"


def replay(line: Mapping[str, Any]) -> Steer:
    """:func:`steer` on what a trace line says it saw."""
    *load, retractions = line["report"]
    slots = [tuple(s) for s in line["slots"]]
    return steer(Load(*load), retractions, Knobs(**line["knobs"]), line["stored"], slots, line["now_ms"])
