"""Capacity-aware admission: a Redis-wide token budget per server, with per-queue caps."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections import Counter

import pytest
import redis

from tests.procs import wait_for
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.admission_view import admission_view, length_view
from tokenmill.errors import ConfigError
from tokenmill.lengths import (
    MIN_AT_RISK,
    MIN_PROMPT_SAMPLE,
    Survival,
    bin_of,
    edge,
    ended_field,
    reached,
    reached_field,
)
from tokenmill.server_report import Load
from tokenmill.settings import Settings
from workers.admission.limiter import YOUNG_CURVE_ENDED, YOUNG_CURVE_TTL_S, Admission, LengthTracker, Slot
from workers.event_loop import LoopThread
from workers.event_loop import run as run_on_worker_loop


def adm(rclient: redis.Redis, **kw: object) -> Admission:
    """Admission on "srv"; the closed loop sizes requests at their whole projected peak unless
    ``admission_reserve`` says otherwise."""
    base = {"admission_fraction": 1.0, "admission_queue_share": 0.75, "admission_reserve": 1.0}
    return Admission(rclient, Settings.load(env={}, **{**base, **kw}))


def admit_alone(req: t.AdmitRequest) -> t.Call[int]:
    """``admit.lua`` alone: 1 admitted, 0 no room, -ms paced (the next start is due in that many ms)."""
    return t.Call("admit", list(req.keys), req.args, int)


def try_admit(a: Admission, server: str, capacity: int | None, tokens: int, queue: str) -> Slot | None:
    """A slot on ``server`` by ``admit.lua`` alone (a worker admits inside ``start.lua``, with the
    claim), or None when its window (or, without a fresh window, its token budget), or the
    queue's share of it, has no room."""
    req = a.request(server, capacity, tokens, queue)
    if req is None:
        return Slot(server, uuid.uuid4().hex, 0)  # no known capacity and no closed loop: not limited
    admitted = a.ledger.call(admit_alone(req))  # 1; 0 no room; < 0 paced
    return Slot(server, str(req.args[0]), tokens) if admitted == 1 else None


def test_budget_bounds_tokens_in_flight_and_release_frees_room(rclient: redis.Redis) -> None:
    a = adm(rclient)
    s1 = try_admit(a, "srv", 1000, 400, "short")
    s2 = try_admit(a, "srv", 1000, 300, "long")
    assert s1 and s2
    assert try_admit(a, "srv", 1000, 400, "long") is None  # 700 + 400 > 1000
    assert admission_view(rclient, "srv")["total"] == 700
    a.release(s1)
    assert try_admit(a, "srv", 1000, 400, "long") is not None
    view = admission_view(rclient, "srv")
    assert view["total"] == 700 and view["budget"] == 1000 and view["slots"] == 2 and view["refused"] == 1


def test_a_queue_cannot_take_the_whole_budget_while_the_other_is_active(rclient: redis.Redis) -> None:
    a = adm(rclient)
    assert try_admit(a, "srv", 1000, 100, "short")
    assert try_admit(a, "srv", 1000, 700, "long")
    assert try_admit(a, "srv", 1000, 100, "long") is None  # long's cap is 750 while short runs
    assert try_admit(a, "srv", 1000, 100, "short")  # short still has room


def test_an_idle_queues_share_is_not_wasted(rclient: redis.Redis) -> None:
    a = adm(rclient)
    assert try_admit(a, "srv", 1000, 700, "long")
    assert try_admit(a, "srv", 1000, 250, "long")  # short is idle: long may use the whole budget
    assert try_admit(a, "srv", 1000, 100, "short") is None  # no room; short is now waiting...
    assert try_admit(a, "srv", 1000, 10, "long") is None  # ...so long is capped again


def test_one_request_is_always_admitted_on_an_idle_server(rclient: redis.Redis) -> None:
    a = adm(rclient)
    assert try_admit(a, "srv", 1000, 5000, "short") is not None
    assert try_admit(a, "srv", 1000, 1, "short") is None


def test_a_dead_workers_slots_expire(rclient: redis.Redis) -> None:
    a = adm(rclient, lease_ttl_s=0.2)
    assert try_admit(a, "srv", 1000, 900, "short")
    assert try_admit(a, "srv", 1000, 500, "short") is None
    wait_for(lambda: try_admit(a, "srv", 1000, 500, "short"), 5, "the expired slot to free its tokens")
    assert admission_view(rclient, "srv")["total"] == 500


def test_unknown_capacity_is_not_limited_by_tokens(rclient: redis.Redis) -> None:
    a = adm(rclient)
    assert all(try_admit(a, "srv", None, 10**9, "short") for _ in range(5))
    off = adm(rclient, admission_closed_loop=False)
    slot = try_admit(off, "srv2", None, 10**9, "short")
    assert slot is not None and slot.tokens == 0  # not even counted


# --- the closed loop: a window steered by the server's own figures -------------------------------


def load(running: int, waiting: int = 0, used: int = 0, capacity: int = 10_000) -> Load:
    return Load(running, waiting, used, capacity)


USED = keys.admission_used("srv")


def redis_ms(client: redis.Redis) -> int:
    """Redis's clock in ms, as the scripts read it."""
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def set_window(client: redis.Redis, window: int, **fields: int) -> None:
    """A window on "srv" as a watcher left it just now (fresh), with other fields of its hash."""
    seconds, micros = client.time()
    stamp = seconds * 1000 + micros // 1000
    client.hset(USED, mapping={"window": window, "window_ms": stamp, **fields})


def test_a_stale_window_starts_again_from_what_is_in_flight(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_queue_target=3)
    client_stale = 1_000  # a window stamped long ago: the token budget decided since
    rclient.hset(USED, mapping={"window": 40, "window_ms": client_stale})
    assert a.adapt("srv", load(0), None) == 2  # nothing in flight: no window, the guard decides
    assert admit_all(a, 5, tokens=100) and admission_view(rclient, "srv")["rule"] == "budget"


def test_the_first_figures_start_from_what_is_in_flight_and_may_grow_at_once(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_queue_target=3)
    # Given 5 requests the token budget let in, each projected to peak at 400 tokens
    assert all(try_admit(a, "srv", 10_000, 400, "short") for _ in range(5))
    # When the server first reports them (100 tokens each so far), the window starts at as many
    # as the guard lets in at 400 each, whether or not they asked yet: 23 below the ceiling (the
    # lower of it and the guard's budget)
    assert a.adapt("srv", load(5, used=500), None) == 23


def admit_all(a: Admission, n: int, queue: str = "short", tokens: int = 10**6) -> list[Slot]:
    """Up to ``n`` slots, stopping at the first refusal."""
    slots = []
    for _ in range(n):
        slot = try_admit(a, "srv", 1000, tokens, queue)
        if slot is None:
            break
        slots.append(slot)
    return slots


def test_a_fresh_window_counts_requests_whatever_their_size(rclient: redis.Redis) -> None:
    a = adm(rclient)
    set_window(rclient, 2)
    slots = admit_all(a, 10)  # each asks far more tokens than the budget: the window decides
    assert len(slots) == 2 and admission_view(rclient, "srv")["rule"] == "window"
    a.release(slots[0])
    assert try_admit(a, "srv", 1000, 10**6, "short") is not None


def test_the_window_grows_while_the_server_has_room_and_nothing_waits(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_queue_target=3)
    set_window(rclient, 2)
    held = admit_all(a, 3, tokens=500)  # two fit, the third is refused: the window is what limits
    # 2 running use 1,000 (500 each): 19 fit below 9,500, half the 17 more
    assert a.adapt("srv", load(2, used=1000), None) == 2 + 8
    assert a.adapt("srv", load(2, used=1000), None) == 10  # no refusal since: no growth
    held += admit_all(a, 20, tokens=500)
    assert len(held) == 10
    assert a.adapt("srv", load(10, used=9600), None) == 10  # no growth above the usage ceiling
    assert try_admit(a, "srv", 1000, 1, "short") is None
    assert a.adapt("srv", load(8, waiting=2, used=5000), None) == 10  # something waits: no growth
    assert try_admit(a, "srv", 1000, 1, "short") is None
    # 19 would fit at the 500 each they use now, but they were seen holding 960 each: none more
    assert a.adapt("srv", load(10, used=5000), None) == 10


def test_the_window_jumps_while_the_pool_has_room_for_many_and_stops_where_it_would_be_full(
    rclient: redis.Redis,
) -> None:
    a = adm(rclient, admission_queue_target=3)
    # 10 in flight, each projected to peak at 400 tokens (the safe prior: prompt + max_tokens)
    set_window(rclient, 10, n=10, total=4000, refused=1)
    # they use 100 tokens now; at 400 each, 23 fit below 9,500: half the 13 more
    assert a.adapt("srv", load(10, used=100), None) == 10 + 6
    # 21 in flight: 2 more would fit: one
    rclient.hset(USED, mapping={"n": 21, "total": 8400, "refused": 2})
    assert a.adapt("srv", load(21, used=6000), None) == 16 + 1
    # 23 in flight would fill the pool at their peaks: no growth, whatever they use now
    rclient.hset(USED, mapping={"n": 23, "total": 9200, "refused": 3})
    assert a.adapt("srv", load(23, used=5000), None) == 17


def test_the_reserve_sizes_a_request_by_its_present_use_and_a_share_of_its_projected_growth(
    rclient: redis.Redis,
) -> None:
    a = adm(rclient, admission_queue_target=3, admission_reserve=0.5)
    # 10 in flight (15 admitted since the window started, 5 ended: they did not all start
    # together), projected to peak at 400 each, using 100 each now: sized 100 + 0.5 * 300 = 250,
    # 38 fit below 9,500: half the 28 more (at the whole peak: half of 13)
    set_window(rclient, 10, n=10, admitted=15, total=4000, refused=1)
    assert a.adapt("srv", load(10, used=1000), None) == 10 + 14
    # using more than projected (the projection lags): sized by the present use alone
    rclient.hset(USED, mapping={"n": 24, "admitted": 36, "total": 4800, "refused": 2})
    assert a.adapt("srv", load(24, used=7200), None) == 24 + 3  # 300 each: 31 fit, half of 7


def test_requests_that_peaked_together_size_the_window_while_their_successors_are_young(
    rclient: redis.Redis,
) -> None:
    # Given 17 requests of ~23-token prompts and outputs that all run to max_tokens 200 (a cold
    # start's batch: they started together), projected at their peaks, 223 tokens each
    a = adm(rclient, admission_queue_target=3, admission_reserve=0.6)
    set_window(rclient, 17, n=17, total=17 * 223, refused=1)
    # When the server reports them at their peak together (214 each), and then their successors
    # just started (25 each), with a request refused each time
    assert a.adapt("srv", load(17, used=17 * 214, capacity=4000), None) == 17
    rclient.hset(USED, mapping={"refused": 2, "admitted": 17})  # the 17 ended, 17 successors in
    # Then the window does not grow: sized by present use and 0.6 of the growth (25 + 0.6 * 198),
    # 26 would fit and 21 would overflow the pool when they peak together again; sized by the
    # 214 each they were seen to hold at once, none more fits
    assert a.adapt("srv", load(17, used=17 * 25, capacity=4000), None) == 17


@pytest.mark.parametrize(("life_dev", "grown"), [(500, 17 + 1), (100, 17)], ids=["spread", "alike"])
def test_the_use_seen_together_expires_a_lifetime_later_once_lifetimes_disagree(
    rclient: redis.Redis, life_dev: int, grown: int
) -> None:
    # Given a cold start's 17 requests, which started together, seen at their peak together (214
    # tokens each), and then as many ended as were in flight, living 1 s on average (pacing off:
    # requests that live alike are paced otherwise, and sized by rule 3', not by what was seen)
    a = adm(rclient, admission_queue_target=3, admission_reserve=0.6, admission_pacing=False)
    set_window(rclient, 17, n=17, total=17 * 223, refused=1, life_ms=1_000, life_dev=life_dev)
    assert a.adapt("srv", load(17, used=17 * 214, capacity=4000), None) == 17
    rclient.hset(USED, mapping={"refused": 2, "admitted": 34})
    # When their successors, at 120 tokens each, are refused within a lifetime of that peak
    assert a.adapt("srv", load(17, used=17 * 120, capacity=4000), None) == 17
    # and again a lifetime later
    seconds, micros = rclient.time()
    rclient.hset(USED, mapping={"refused": 3, "seen_ms": seconds * 1000 + micros // 1000 - 1_100})
    # Then where lifetimes disagree (deviation 500 ms: outputs end at different lengths, and the
    # batch that started together no longer runs together) the peak seen no longer sizes the
    # window: at 120 + 0.6 of the growth to 223 each, 20 fit, and it grows by half the 3 more
    # (at least one); where they agree, the requests' successors start and peak together again,
    # and the 214 each seen keeps the window at 17
    assert a.adapt("srv", load(17, used=17 * 120, capacity=4000), None) == grown


def test_requests_that_peak_between_two_figures_are_sized_by_the_rise_they_were_seen_on(
    rclient: redis.Redis,
) -> None:
    # Given 17 requests that started together and run to max_tokens 200 (223 tokens each at their
    # peak), as many ended before them, on a 4,000-token pool read every half second
    a = adm(rclient, admission_queue_target=3, admission_reserve=0.6)
    set_window(rclient, 17, n=17, admitted=34, total=17 * 223)
    # When the figures show them at 98 tokens each, then at 190 (they end before the next figures)
    a.adapt("srv", load(17, used=17 * 98, capacity=4000), None)
    a.adapt("srv", load(17, used=17 * 190, capacity=4000), None)
    # and then their successors, young, with a request refused
    rclient.hset(USED, mapping={"refused": 1, "admitted": 51})
    # Then the window does not grow: sized by the 190 seen, 20 would fit, but rising 92 tokens a
    # reading they reached their projected peak (223) before they ended, where 17 fit
    assert a.adapt("srv", load(17, used=17 * 25, capacity=4000), None) == 17


def test_a_rise_projected_under_the_cold_prior_gives_way_once_the_run_learns_outputs_end_early(
    rclient: redis.Redis,
) -> None:
    # Given a cold start's 17 requests, projected at 223 tokens each (nothing has ended: every
    # output is assumed to reach max_tokens), seen at 60 then 150 tokens each: rising 90 a
    # reading, they would be past their projected peak by the next figures
    a = adm(rclient, admission_queue_target=3, admission_reserve=0.6)
    set_window(rclient, 17, n=17, admitted=17, total=17 * 223)
    a.adapt("srv", load(17, used=17 * 60, capacity=4000), None)
    a.adapt("srv", load(17, used=17 * 150, capacity=4000), None)
    # When half of them ended early, and the run's lengths now project the 17 in flight (the
    # rest and their successors) at 137 each, the young successors using 40, a request refused
    rclient.hset(USED, mapping={"n": 17, "admitted": 34, "total": 17 * 137, "refused": 1})
    # Then the rise gives way to the projection: sized by the 150 each the server did report,
    # 25 fit below 3,800: half the 8 more (sized by the rise capped at the first projection,
    # 223, none would)
    assert a.adapt("srv", load(17, used=17 * 40, capacity=4000), None) == 17 + 4


def test_slots_given_back_between_two_figures_are_not_room_to_grow(rclient: redis.Redis) -> None:
    # Given a window of 17, as many as fit at the 220 tokens each they were seen to hold at once,
    # and a batch ending: 2 slots given back, their successors not yet admitted
    a = adm(rclient, admission_queue_target=3, admission_reserve=0.6)
    set_window(
        rclient, 17, n=15, admitted=34, start_admitted=17, start_n=17, total=15 * 223, refused=1,
        seen_each=220,
    )  # fmt: skip
    # When the figures come in then, the window does not grow into the 2 free places
    assert a.adapt("srv", load(15, used=15 * 60, capacity=4000), None) == 17


def test_a_cold_starts_first_batch_is_sized_at_its_whole_peak_until_half_as_many_ended(
    rclient: redis.Redis,
) -> None:
    # Given a cold start: before the first figures the token guard let 16 in, each held at its
    # projected peak (prompt + max_tokens: 223 tokens) against 0.9 of a 4,000-token pool (not
    # paced: the slots below live a few milliseconds)
    a = adm(
        rclient, admission_fraction=0.9, admission_queue_target=3, admission_reserve=0.6,
        admission_pacing=False,
    )  # fmt: skip
    slots = [try_admit(a, "srv", 4000, 223, "short") for _ in range(17)]
    assert slots.count(None) == 1  # the 17th was refused: the budget is what limits
    # When the first figures show them young (60 tokens each), none ended
    # Then the window starts at the 16 and does not grow: sized by projection alone, at their
    # whole peaks, 16 of 223 fit in the guard's 3,600 (the 17 the 3,800 ceiling would hold
    # overflowed SGLang's pool when the prompts were longer than guessed), and not at
    # 60 + 0.6 * 163 each (24 fit: 20), which started together would overflow the pool when they
    # peak together
    assert a.adapt("srv", load(16, used=16 * 60, capacity=4000), None) == 16
    assert try_admit(a, "srv", 4000, 223, "short") is None
    assert a.adapt("srv", load(16, used=16 * 120, capacity=4000), None) == 16
    # And while fewer than half of those in flight ended (their successors admitted), the rest
    # of the batch has yet to peak: still sized at their whole peaks; once half ended, the reserve
    # sizes the young ones again, below the ceiling
    first_batch = [slot for slot in slots if slot is not None]
    for ended in range(1, 9):
        a.release(first_batch[ended - 1])
        assert try_admit(a, "srv", 4000, 223, "short") is not None
        assert try_admit(a, "srv", 4000, 223, "short") is None
        window = a.adapt("srv", load(16, used=(16 - ended) * 120 + ended * 25, capacity=4000), None)
        assert window == 16 if ended < 8 else window > 16


@pytest.mark.parametrize(
    ("len_dev", "len_n", "grown"), [(25, 4, 16 + 4), (0, 4, 16), (150, 1, 16)], ids=["differ", "alike", "one"]
)
def test_once_outputs_end_at_different_lengths_a_cold_batch_no_longer_holds_the_window(
    rclient: redis.Redis, len_dev: int, len_n: int, grown: int
) -> None:
    # Given a cold start's 16 requests, projected at 223 tokens each (prompt + max_tokens 200),
    # seen at 150 then 156 tokens each on a 4,000-token pool (rising 6 a reading)
    a = adm(
        rclient, admission_fraction=0.9, admission_queue_target=3, admission_reserve=0.6,
        admission_pacing=False,
    )  # fmt: skip
    set_window(rclient, 16, n=16, admitted=16, total=16 * 223)
    a.adapt("srv", load(16, used=16 * 150, capacity=4000), None)
    a.adapt("srv", load(16, used=16 * 156, capacity=4000), None)
    # When 4 of them ended (fewer than half), their successors young (25 tokens), a request
    # refused, and the outputs' moving mean is 150 tokens, over `len_n` outputs, `len_dev` apart
    lengths = {"len_mean": 150, "len_dev": len_dev, "len_n": len_n}
    rclient.hset(USED, mapping={"admitted": 20, "refused": 1, **lengths})
    window = a.adapt("srv", load(16, used=12 * 170 + 4 * 25, capacity=4000), None)
    # Then where they differ, the rest of the batch will not peak together: each request is sized
    # by its present use and 0.6 of its growth (134 + 0.6 * 89), not by the batch's rise (162) nor
    # at its whole peak, and the window takes all 4 more that fit below 3,800 at once. Where they
    # are of one length (or only one is known), the batch still peaks together: 16, as before
    assert window == grown


def test_a_retraction_does_not_take_the_window_below_what_fits_at_the_projected_peaks(
    rclient: redis.Redis,
) -> None:
    a = adm(rclient, admission_backoff=0.75)
    # 21 in flight, projected at 223 tokens each: 17 of them fit below 3,800 even all at their peaks
    set_window(rclient, 21, n=21, total=21 * 223)
    a.adapt("srv", load(18, waiting=3, used=3850, capacity=4000), 0)
    # the retraction takes the window to 17, not 0.75 of the 21 on the server (15)
    assert a.adapt("srv", load(18, waiting=3, used=3850, capacity=4000), 4) == 17


def test_with_nothing_to_size_a_request_by_the_window_grows_by_the_target(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_queue_target=3)
    set_window(rclient, 4, refused=1)
    assert a.adapt("srv", load(0), None) == 4 + 3


def test_a_deep_server_queue_shrinks_the_window_to_running_plus_the_target(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_queue_target=4)
    set_window(rclient, 40)
    assert a.adapt("srv", load(20, waiting=30, used=9000), None) == 40  # once: a burst, maybe
    assert a.adapt("srv", load(20, waiting=30, used=9000), None) == 24  # twice: a queue
    assert a.adapt("srv", load(100, waiting=30, used=9000), None) == 24  # target: 10% of running


def test_a_window_starts_its_requests_in_groups_spread_over_a_lifetime(rclient: redis.Redis) -> None:
    # Given a fresh window of 10 with room, and requests known to live 10 s give or take 1 s: one
    # start a second
    a = adm(rclient, admission_queue_target=3)
    set_window(rclient, 10, life_ms=10_000, life_dev=1_000, bound=1)
    # When 10 ask at once, then a group (admission_pace_group: 2) starts, and the rest wait their
    # turn, refused as paced, not as refused by the window (which would grow it)
    assert len(admit_all(a, 10)) == 2
    assert rclient.hmget(USED, "paced", "refused") == [b"1", None]
    # And they all start at once when lifetimes differ by an eighth of their mean or more
    # (requests started together end apart), or with pacing off
    for fields, pacing in (({"life_dev": 1_500}, True), ({}, False)):
        rclient.delete(USED, keys.admission("srv"))
        set_window(rclient, 10, **{"life_ms": 10_000, "life_dev": 1_000, "bound": 1, **fields})
        assert len(admit_all(adm(rclient, admission_queue_target=3, admission_pacing=pacing), 10)) == 10
    # And a larger group starts that many at once
    rclient.delete(USED, keys.admission("srv"))
    set_window(rclient, 10, life_ms=10_000, life_dev=1_000, bound=1)
    assert len(admit_all(adm(rclient, admission_queue_target=3, admission_pace_group=4), 10)) == 4


def test_a_paced_group_opens_when_all_its_starts_are_due_and_they_start_together(
    rclient: redis.Redis,
) -> None:
    # Given a window of 10 whose requests live 10 s (a start a second, groups of 2), whose first
    # group just started
    a = adm(rclient, admission_queue_target=3)
    set_window(rclient, 10, life_ms=10_000, life_dev=1_000, bound=1)
    assert len(admit_all(a, 10)) == 2
    seconds, micros = rclient.time()
    now_ms = seconds * 1000 + micros // 1000

    def opened(ms_ago: int) -> None:  # the group opened that long ago; its starts gave 2 s credit
        rclient.hset(USED, mapping={"pace_open": now_ms - ms_ago, "pace_tat": now_ms - ms_ago + 2_000})

    # When one pace has passed since the group opened (one start is due, not the group's two)
    opened(1_000)
    # Then none starts: the group is spent, and the next opens when both its starts are due
    assert admit_all(a, 10) == []
    # (the refusal says so: the next group opens in a second)
    req = a.request("srv", 1000, 10, "short")
    assert req is not None
    # (a second, less the time since the figures were set: a fixed bound on that a loaded machine misses)
    assert -1_000 <= a.ledger.call(admit_alone(req)) <= -1_000 + redis_ms(rclient) - now_ms
    # When both are due, the group opens and its two start together, and no third
    opened(2_000)
    assert len(admit_all(a, 10)) == 2


def spread_in_flight(client: redis.Redis, count: int = 10, life_s: int = 10, peak: int = 300) -> None:
    """A paced window of ``count`` on "srv" with as many requests in flight, ``life_s`` seconds a
    lifetime, started a second apart (ages 0 .. count - 1 s), each growing from 30 tokens to
    ``peak``; the server just reported what they hold together, and the watcher fitted their
    young size to it (``young_fit``, as policy.py does)."""
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    held = 0.0
    for age in range(count):
        member = f"m{age}"
        client.zadd(keys.admission("srv"), {member: now_ms + 60_000})
        client.hset(
            USED,
            mapping={f"slot:{member}": peak, f"slotq:{member}": "short", f"at:{member}": now_ms - age * 1000},
        )
        held += 30 + (peak - 30) * age / life_s
    set_window(
        client,
        count,
        n=count,
        total=count * peak,
        **{"n:short": count, "short": count * peak},
        life_ms=life_s * 1000,
        life_dev=100,
        bound=1,
        srv_used=round(held),
        young_fit=30,
    )


def tail_admit(a: Admission, behind: int | None, tokens: int = 300) -> int:
    """admit.lua on a 4,000-token pool for a request of ``tokens`` at its peak, told how many of
    its run are still to start (``start.lua`` tells it; None: not told)."""
    req = a.request("srv", 4000, tokens, "short")
    assert req is not None
    return a.ledger.call(
        admit_alone(t.AdmitRequest(req.keys, [*req.args, *([] if behind is None else [behind])]))
    )


def test_the_runs_last_requests_start_at_once_when_together_they_fit_until_they_end(
    rclient: redis.Redis,
) -> None:
    # Given ten requests in flight spread over their 10 s lifetimes (the window is full), each
    # growing from 30 tokens to 300 (the server reports their 1,515 tokens), on a 4,000 pool
    a = adm(rclient, admission_queue_target=3)
    spread_in_flight(rclient)
    # When another run's request asks (not told how many are left): the full window refuses it
    assert tail_admit(a, None) == 0
    # When the run has 12 left (13 would not fit now: see the next test), all 12 start at once,
    # past the full window and the pace
    assert [tail_admit(a, left) for left in range(12, 0, -1)] == [1] * 12
    u = rclient.hgetall(USED)
    assert (u[b"n"], u[b"tail"], u[b"tailed"], u[b"unpaced"]) == (b"22", b"12", b"12", b"12")
    # And while they are in flight, another request (another run's: not told how many are left)
    # with room in the window starts only if the projection has room for it too
    rclient.hset(USED, "window", 40)
    assert tail_admit(a, None) == 0
    assert tail_admit(a, None, tokens=30) == 1  # one that stays at 30 tokens fits
    # And once they have ended, the window decides again
    tail = [m.decode() for m in rclient.zrange(keys.admission("srv"), 0, -1) if not m.startswith(b"m")]
    for member in tail[:13]:
        a.release(Slot("srv", member, 300))
    assert rclient.hget(USED, "tail") == b"0"
    set_window(rclient, 40)
    assert tail_admit(a, None) == 1


def test_a_mix_of_outputs_does_not_start_the_runs_last_requests_together(
    rclient: redis.Redis,
) -> None:
    # Given the ten requests in flight of the test above, on a run whose outputs are a mix: a
    # moving mean of 150 tokens and a deviation of 30 (a fifth of it; their lifetimes alike)
    a = adm(rclient, admission_queue_target=3)
    spread_in_flight(rclient)
    rclient.hset(USED, mapping={"len_mean": 150, "len_dev": 30})
    # When the run's last 12 ask: their projected peaks are expectations, not bounds (half of a
    # mix started together runs long), so the full window refuses them as it refuses any other
    assert [tail_admit(a, left) for left in range(12, 9, -1)] == [0, 0, 0]
    assert rclient.hget(USED, "tailed") is None
    # And once the outputs are of one length (a deviation under an eighth of the mean), the
    # run's last requests start together
    rclient.hset(USED, "len_dev", 15)
    assert tail_admit(a, 12) == 1
    assert rclient.hget(USED, "tailed") == b"1"


def test_the_runs_last_requests_wait_for_room_together_only_while_that_ends_sooner_than_pacing(
    rclient: redis.Redis,
) -> None:
    # Given ten requests in flight spread over their 10 s lifetimes and a window of 11 (room for
    # one more; a start every 909 ms, in groups of 2), on a 4,000 pool
    a = adm(rclient, admission_queue_target=3)
    since_ms = redis_ms(rclient)
    spread_in_flight(rclient)
    rclient.hset(USED, "window", 11)
    # When 3 are left, of 1,300 tokens at their peaks: together they fit only once the youngest
    # in flight has ended (10 s; before, its 300 beside their 3,900), later than pacing would
    # start them (in 909 ms): the next start is paced as usual, and goes now, opening a group
    assert tail_admit(a, 3, tokens=1_300) == 1
    assert rclient.hget(USED, "tail") is None  # not started as the tail
    started = next(m.decode() for m in rclient.zrange(keys.admission("srv"), 0, -1) if not m.startswith(b"m"))
    a.release(Slot("srv", started, 1_300))
    # When the run's last 13 requests ask (the group is open: pacing would start one now):
    # together they fit once the oldest in flight ends, in a second, and paced the last of them
    # would start in 10 s: the request waits for then (a second less the time since the figures)
    assert -1_001 <= tail_admit(a, 13) <= -1_000 + redis_ms(rclient) - since_ms + 1
    # And so does another run's request (not told how many are left), which pacing alone would
    # start sooner, at the next pace (909 ms): it would take the room the tail waits for
    assert -1_001 <= tail_admit(a, None) <= -1_000 + redis_ms(rclient) - since_ms + 1


def test_the_watcher_fits_the_young_size_of_the_requests_in_flight_to_the_servers_figures(
    rclient: redis.Redis,
) -> None:
    # Given ten requests in flight, aged 0 to 9 s of their 10 s lifetimes, projected to peak at
    # 300 tokens, and a server that reports 1,515 tokens held by them
    a = adm(rclient, admission_queue_target=3)
    spread_in_flight(rclient)
    rclient.hdel(USED, "young_fit")
    # When the watcher reads those figures: then the young size that makes them hold 1,515,
    # each grown linearly from it to 300 over its lifetime, is 30
    a.adapt("srv", load(10, used=1515), None)
    assert 29 <= float(rclient.hget(USED, "young_fit") or -1) <= 31
    # And a server that reports more (longer prompts than projected) gives a larger one
    a.adapt("srv", load(10, used=2065), None)
    assert 129 <= float(rclient.hget(USED, "young_fit") or -1) <= 131


def test_a_pace_group_under_one_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match="admission_pace_group must be at least 1, got 0"):
        Settings.load(env={"TOKENMILL_ADMISSION_PACE_GROUP": "0"})


def test_a_slots_lifetime_and_its_spread_are_measured_and_pace_the_window(rclient: redis.Redis) -> None:
    # Given requests that held their slots 200 ms, 200 ms and 400 ms (their admission time set back)
    a = adm(rclient, admission_queue_target=3)
    slots = [try_admit(a, "srv", 10_000, 100, "short") for _ in range(3)]
    seconds, micros = rclient.time()
    now_ms = seconds * 1000 + micros // 1000
    lives = []
    for slot, held_ms in zip(slots, (200, 200, 400), strict=True):
        assert slot is not None
        rclient.hset(USED, f"at:{slot.member}", now_ms - held_ms)
        a.release(slot)
        lives.append(float(rclient.hget(USED, "life_ms") or 0))
    # Then the lifetime is a moving mean (the plain mean of the first ten), its spread a moving
    # mean deviation (200, as large as the one lifetime known; then 0; then half of (200 off the
    # mean + 0))
    assert 200 <= lives[0] < 220 and lives[1] < 225 and 260 <= lives[2] < 290
    dev = float(rclient.hget(USED, "life_dev") or 0)
    assert 90 < dev < 110
    # And while the pool binds (4 in flight at 3,000 tokens each on a 10,000-token pool: a fifth
    # would not fit), the window's requests start a lifetime / window apart
    set_window(rclient, 4, life_dev=10, n=4, total=4 * 3_000)
    window = a.adapt("srv", load(0), None)
    assert int(rclient.hget(USED, "pace_ms") or 0) == int(lives[2] // window)
    # And once the pool has bound, pacing stays (as requests end and in flight fall below the
    # fit, it must not flap); a window that never saw it bind (room for more at their peaks)
    # does not pace
    rclient.hset(USED, "total", 4 * 1_000)
    a.adapt("srv", load(0), None)
    assert rclient.hmget(USED, "bound") == [b"1"]
    rclient.hdel(USED, "bound")
    a.adapt("srv", load(0), None)
    assert rclient.hmget(USED, "pace_ms", "bound") == [b"0", b"0"]


def test_outputs_of_one_length_are_paced_though_their_lifetimes_differ_and_mixed_ones_are_not(
    rclient: redis.Redis,
) -> None:
    # Given a bound window of 10 whose requests' lifetimes differ by more than a quarter (on a CPU
    # a lifetime moves with the server's batch: a slow ramp's first requests lived 2/3 as long)
    a = adm(rclient, admission_queue_target=3)
    fields = {"life_ms": 10_000, "life_dev": 3_000, "bound": 1}
    # When their outputs were all 200 tokens, then they are paced: a group starts, the rest wait
    set_window(rclient, 10, **fields, len_mean=200, len_dev=0)
    assert len(admit_all(a, 10)) == 2
    a.adapt("srv", load(2), None)
    assert int(rclient.hget(USED, "pace_ms") or 0) > 0
    # And when outputs end at lengths apart (they desynchronise by themselves), they are not,
    # even where lifetimes agree
    rclient.delete(USED, keys.admission("srv"))
    set_window(rclient, 10, **{**fields, "life_dev": 100}, len_mean=120, len_dev=60)
    assert len(admit_all(a, 10)) == 10
    a.adapt("srv", load(10), None)
    assert rclient.hget(USED, "pace_ms") == b"0"
    # And outputs half of which run to max_tokens, the rest spread below it (a mean deviation of
    # nearly a quarter of the mean: a cohort started together ends spread over a lifetime), are not
    rclient.delete(USED, keys.admission("srv"))
    set_window(rclient, 10, **{**fields, "life_dev": 100}, len_mean=160, len_dev=38)
    assert len(admit_all(a, 10)) == 10
    # And the lengths are measured at each release that says how many tokens the request made:
    # their plain mean, and the mean deviation from the mean before, unknown from one (as large as
    # it), so that three outputs apart do not read as one length
    rclient.delete(USED, keys.admission("srv"))
    lengths = []
    for out in (60, 90, 120):
        slot = try_admit(a, "srv", 10_000, 100, "short")
        assert slot is not None
        a.ledger.call(t.Call("unadmit", [keys.admission("srv"), USED], [slot.member, out], int))
        lengths.append(rclient.hmget(USED, "len_mean", "len_dev", "len_n"))
    assert lengths == [[b"60", b"60", b"1"], [b"75", b"30", b"2"], [b"90", b"37.5", b"3"]]
    set_window(rclient, 10, **{**fields, "life_dev": 100})
    assert len(admit_all(a, 10)) == 10
    # And from the eleventh on (or without a count: a figure kept before there was one), each
    # moves them a tenth of the way
    rclient.delete(USED, keys.admission("srv"))
    rclient.hset(USED, mapping={"len_mean": 200, "len_dev": 0, "len_n": 11})
    slot = try_admit(a, "srv", 10_000, 100, "short")
    assert slot is not None
    a.ledger.call(t.Call("unadmit", [keys.admission("srv"), USED], [slot.member, 100], int))
    assert rclient.hmget(USED, "len_mean", "len_dev", "len_n") == [b"190", b"10", b"11"]
    rclient.hdel(USED, "len_n")
    slot = try_admit(a, "srv", 10_000, 100, "short")
    assert slot is not None
    a.ledger.call(t.Call("unadmit", [keys.admission("srv"), USED], [slot.member, 90], int))
    assert rclient.hmget(USED, "len_mean", "len_dev", "len_n") == [b"180", b"19", b"11"]


def test_paced_requests_young_size_comes_from_their_length_and_the_window_follows_the_fit_down(
    rclient: redis.Redis,
) -> None:
    # Given paced requests with 223-token projected peaks whose outputs are 120 tokens long
    # (moving mean, alike), and a least mean use seen (20) from figures taken as a cold start's
    # batch had barely started
    a = adm(rclient, admission_queue_target=3, admission_reserve=0.6)
    paced = {"life_ms": 1_200, "life_dev": 10, "len_mean": 120, "len_dev": 5, "unpaced": 0}
    set_window(rclient, 17, n=4, admitted=40, total=4 * 223, bound=1, use_min=20, **paced)
    # Then a request is young at its peak less its output (103), not at the 20 seen: halfway to
    # its peak, 163 each, with room for a group's growth, (3,800 - 2 * 120) / 163
    assert a.adapt("srv", load(4, used=4 * 110, capacity=4000), None) == 21
    # And when the requests in flight are projected to hold more (the run learned its prompts
    # are longer: 300-token peaks), the window comes down to what fits: (3,800 - 240) / 240
    rclient.hset(USED, mapping={"n": 21, "total": 21 * 300})
    assert a.adapt("srv", load(21, used=21 * 150, capacity=4000), None) == 14


def test_paced_requests_are_sized_by_their_mean_use_over_time_not_by_their_peak_together(
    rclient: redis.Redis,
) -> None:
    # Given a cold start's 17 requests of ~23-token prompts that all run to max_tokens 200
    # (223-token projected peaks: 17 fit below 3,800), started together (unpaced), seen at 60,
    # 120 and 180 tokens each as they grew together
    a = adm(rclient, admission_queue_target=3, admission_reserve=0.6)
    set_window(rclient, 17, n=17, admitted=17, total=17 * 223, refused=1, unpaced=17)
    for each in (60, 120, 180):
        assert a.adapt("srv", load(17, used=17 * each, capacity=4000), None) == 17
    # When they have ended together, as long as each other (1.2 s, give or take 10 ms), and their
    # successors are starting paced, young (25 tokens each)
    lives = {"life_ms": 1_200, "life_dev": 10, "admitted": 21, "n": 4, "total": 4 * 223}
    rclient.hset(USED, mapping={**lives, "unpaced": 0})
    # Then the window is as many as fit at what they hold on average over a lifetime: halfway
    # between their young size (60, the least seen) and their projected peak (223), or the mean
    # seen over time (120) if more, with room for the spread's unevenness: a group's growth from
    # young to peak, (3,800 - 2 * (223 - 60)) / 141.5
    assert a.adapt("srv", load(4, used=4 * 25, capacity=4000), None) == 24
    # And not while one that started unpaced (with others, maybe) is in flight, nor when
    # lifetimes differ by an eighth of their mean: successors that start together end apart
    for fields in ({"unpaced": 1}, {"life_dev": 200}):
        rclient.hset(USED, mapping={**lives, "unpaced": 0, "window": 17, **fields})
        assert a.adapt("srv", load(4, used=4 * 25, capacity=4000), None) == 17
    # And once the server retracted paced requests (23 of them, at their stages, overflowed),
    # the window backs off, and after the hold the pacing rule takes it back up to one fewer
    # than were in flight (not to the 23 that fit by their sizing, and not only to where it
    # backed off to, for the rest of the run); another retraction: one fewer again
    rclient.hset(USED, mapping={**lives, "unpaced": 0, "window": 23, "n": 23, "total": 23 * 223})
    a.adapt("srv", load(22, waiting=1, used=3900, capacity=4000), 0)
    backed = a.adapt("srv", load(22, waiting=1, used=3900, capacity=4000), 2)
    assert backed == 17  # what fits at the projected peaks (0.75 of the 23 on the server: 17)
    rclient.hset(USED, mapping={"n": 4, "total": 4 * 223})
    assert a.adapt("srv", load(4, used=4 * 25, capacity=4000), 2) == 17  # held still
    rclient.hset(USED, "hold_until", 0)
    assert a.adapt("srv", load(4, used=4 * 25, capacity=4000), 2) == 22
    rclient.hset(USED, mapping={"n": 22, "total": 22 * 223})
    assert a.adapt("srv", load(22, used=3900, capacity=4000), 3) == 17
    rclient.hset(USED, mapping={"hold_until": 0, "n": 4, "total": 4 * 223})
    assert a.adapt("srv", load(4, used=4 * 25, capacity=4000), 3) == 21


def test_a_retraction_shrinks_the_window_and_holds_it_there(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_backoff=0.5)
    set_window(rclient, 20, n=20)
    assert a.adapt("srv", load(16, waiting=4, used=9900), 3) == 20  # first reading: just noted
    assert a.adapt("srv", load(16, waiting=4, used=9900), 5) == 10  # two more: half of 20
    assert a.adapt("srv", load(10, used=100), 5) == 10  # held: no growth during the hold
    assert a.adapt("srv", load(10, used=100), 9) == 10  # retractions of the same overflow: noted
    assert admission_view(rclient, "srv")["backoffs"] == 1


def test_a_stale_window_leaves_the_decision_to_the_token_budget(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_poll_s=0.02)  # fresh for 6 polls: 120 ms
    set_window(rclient, 2)
    assert len(admit_all(a, 5, tokens=100)) == 2
    wait_for(lambda: try_admit(a, "srv", 1000, 100, "short"), 5, "the window to go stale")
    assert admission_view(rclient, "srv")["rule"] == "budget"


def test_in_a_window_a_queue_gets_its_share_while_the_other_is_active(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_queue_share=0.5)
    set_window(rclient, 8)
    a.adapt("srv", load(0), None)
    assert len(admit_all(a, 8, "long")) == 8  # short idle: long may fill the window
    assert try_admit(a, "srv", 1000, 1, "short") is None  # full; short now wants in...
    set_window(rclient, 12)
    a.adapt("srv", load(8, waiting=1), None)
    assert len(admit_all(a, 10, "short")) == 4 and try_admit(a, "srv", 1000, 1, "long") is None


def test_in_a_window_a_queue_takes_no_more_than_its_share_while_the_other_is_active(
    rclient: redis.Redis,
) -> None:
    # Given a window of 8 that long filled while short was idle, and short now waiting
    a = adm(rclient, admission_queue_share=0.5)
    set_window(rclient, 8)
    a.adapt("srv", load(0), None)
    assert len(admit_all(a, 8, "long")) == 8
    assert try_admit(a, "srv", 1000, 1, "short") is None

    # When the window grows to 24: room for 16 more
    set_window(rclient, 24)
    admitted_short = len(admit_all(a, 16, "short"))

    # Then short takes its share of the window (12), not all the room, and long the rest
    assert (admitted_short, len(admit_all(a, 16, "long"))) == (12, 4)
    assert admission_view(rclient, "srv")["rule"] == "window"


def curve(lengths: list[int], running: list[int] = (), max_tokens: int = 100_000) -> Survival:
    """The survival curve a run reports after ``lengths`` ended and ``running`` reached so far."""
    reached_n: Counter[int] = Counter()
    ended_n: Counter[int] = Counter()
    for n in lengths:
        reached_n.update(reached(-1, min(n, max_tokens)))
        ended_n[bin_of(min(n, max_tokens))] += 1
    for g in running:
        reached_n.update(reached(-1, g))
    return Survival.from_counts(reached_n, ended_n)


def test_length_bins_tile_the_token_line_and_are_at_most_an_eighth_wide() -> None:
    for b in range(120):
        lo, hi = edge(b), edge(b + 1)
        assert bin_of(lo) == b and bin_of(hi - 1) == b
        assert hi - lo <= max(16, lo // 8)
    assert reached(-1, 0) == [0] and reached(-1, 40) == [0, 1, 2] and reached(40, 47) == []


def test_before_any_request_ends_each_one_is_projected_to_reach_max_tokens() -> None:
    # Given no data, or requests that are running but none ended (the prior)
    for c in (Survival(), curve([], running=[300, 900])):
        # Then a new request, and one past every length seen, holds prompt + max_tokens
        assert c.hold(100, 4096) == 4196 and c.tail == 1.0
    assert curve([], running=[300, 900]).hold(100, 4096, 950) == 4196
    assert curve([400] * 5, running=[600] * 15).hold(100, 4096, 2000) == 4196


def test_a_known_length_distribution_projects_the_expected_peak_not_the_sum_of_maxima() -> None:
    # Given lengths spread evenly over 375..2625 (mean 1,500), all seen to the end
    c = curve(list(range(375, 2626, 5)))
    # Then a new request of prompt 100 holds max_x (100 + x) P(L >= x) = 825 (+ at most 1/8 for
    # rounding x up to its bin's edge), not 100 + 1,500 per request: requests started together
    # free their KV as they end, so they never all peak at once
    assert 825 <= c.hold(100, 4096) <= 825 * 1.125
    # And the hold follows a running request: (100 + x) P(L >= x | L >= 1262) peaks at x = 1262
    assert 1362 <= c.hold(100, 4096, 1262) <= 1362 * 1.125
    assert 2700 <= c.hold(100, 4096, 2600) <= 100 + edge(bin_of(2600) + 1)
    assert c.hold(100, 4096, 5000) == 5100  # past max_tokens: what it holds
    assert 1500 <= (c.mean_known() or 0) <= 1530 and c.tail == 0.0


def test_requests_still_running_keep_the_first_short_completions_from_biasing_it_low() -> None:
    # Given 40 requests started together: the 10 shortest ended at ~400, 30 are still at 600
    ended_only = curve([400] * 10)
    with_running = curve([400] * 10, running=[600] * 30)
    # Then counting only the ended ones would project ~500; the survivors keep 75% of the mass
    # beyond the data, projected to max_tokens
    assert ended_only.hold(100, 4096) <= 550
    assert with_running.tail == 0.75
    assert with_running.hold(100, 4096) == int(0.75 * 4196 + 0.999)


def test_lengths_too_few_requests_were_seen_to_reach_say_nothing() -> None:
    # Given 17 requests started together with max_tokens 200: one ended at 147 tokens, the 16
    # others had reported reaching 100 at their last heartbeat and still run
    c = curve([147], running=[100] * 16)
    # Then beyond 100 only the one that ended is known: the curve stops there and each request
    # is still projected to reach max_tokens (not to end by 160, as that one did)
    assert c.hold(24, 200) == 224 and c.tail == 1.0
    # while MIN_AT_RISK known to have reached a length are enough to project by
    assert curve([147] * MIN_AT_RISK, running=[100] * 16).hold(24, 200) < 224


def test_requests_cut_at_max_tokens_hold_all_of_it() -> None:
    c = curve([5000] * 50, max_tokens=1000)  # every request truncated at max_tokens
    assert c.hold(100, 1000) == 1100 and c.hold(100, 1000, 500) == 1100


def test_estimate_uses_the_runs_length_curve_from_redis(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_default_output_tokens=1000)
    request = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 5000}
    assert a.held("r", request, 0) == 104 + 5000  # nothing known: max_tokens
    assert a.held("r", {"messages": request["messages"]}, 0) == 104 + 1000  # no max_tokens: the default
    # When 40 requests of the run end at 200 tokens (reported as a worker does)
    ledger_fields: Counter[str] = Counter()
    for _ in range(40):
        tracker = LengthTracker(lambda g: 0, 0)
        for update in (tracker.update(64), tracker.update(150)):
            ledger_fields.update(reached_field(b) for b in update.reached)
        report = tracker.finish(200)
        ledger_fields.update([ended_field(report.ended), *map(reached_field, report.reached)])
    rclient.hset("tm:r2:lengths", mapping=dict(ledger_fields))
    # Then a request of that run is projected to hold its prompt plus ~200
    assert 104 + 200 <= a.held("r2", request, 0) <= 104 + edge(bin_of(200) + 1)
    assert a.held("r2", request, 190) == a.held("r2", request, 0)
    view = length_view(rclient, "r2")
    assert view["ended"] == 40 and view["running"] == 0 and view["unknown_tail"] == 0
    assert view["p50"] == edge(bin_of(200) + 1) and view["mean_known"] == 200


def test_prompts_are_projected_at_the_servers_size_once_enough_requests_reported_theirs(
    rclient: redis.Redis,
) -> None:
    a = adm(rclient)
    request = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 100}  # 104 estimated
    assert a.held("r3", request, 0) == 104 + 100
    # Given requests whose server counted 208 prompt tokens (a chat template's included), 52 of
    # them served from its prefix cache; a continuation and a prompt netted by affinity report none
    usage = {"prompt_tokens": 208, "prompt_tokens_details": {"cached_tokens": 52}, "completion_tokens": 9}
    assert LengthTracker(lambda g: 0, 0, 104).finish(9, usage).prompt == (104, 156)
    assert LengthTracker(lambda g: 0, 0, 104).finish(9, {"prompt_tokens": 208}).prompt == (104, 208)
    assert LengthTracker(lambda g: 0, 0, 104).finish(9, None).prompt is None
    assert LengthTracker(lambda g: 0, 5, 104).finish(9, usage).prompt is None
    assert a.tracker("r3", request, 0, shared=50).finish(9, usage).prompt is None
    # When fewer than MIN_PROMPT_SAMPLE reported, the estimate stands; then the server's size does
    lengths = keys.RunKeys("r3").lengths()
    for reported in range(1, MIN_PROMPT_SAMPLE + 1):
        rclient.hincrby(lengths, "pn", 1)
        rclient.hincrby(lengths, "pe", 104)
        rclient.hincrby(lengths, "pk", 156)
        a._curves.clear()
        expected = 104 if reported < MIN_PROMPT_SAMPLE else 156
        assert a.held("r3", request, 0) == expected + 100, reported
    assert a.held("r3", request, 60) == 156 + 100


def test_a_young_curve_is_read_again_sooner_than_a_settled_one(rclient: redis.Redis) -> None:
    # Given a run in which nothing has ended yet (a cold start): every output projected to
    # reach max_tokens, as this process read the curve
    a = adm(rclient)
    request = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 200}
    cold = a.held("r4", request, 0)
    # When 16 of its requests have ended at 20 tokens
    lengths = keys.RunKeys("r4").lengths()
    for _ in range(16):
        for b in reached(-1, 20):
            rclient.hincrby(lengths, reached_field(b), 1)
        rclient.hincrby(lengths, ended_field(bin_of(20)), 1)
    # Then the process's projections follow within a fraction of a second, not only once its
    # copy is STATS_TTL_S old: every request admitted meanwhile keeps its hold for its life
    wait_for(lambda: a.held("r4", request, 0) < cold, YOUNG_CURVE_TTL_S + 0.5, "the young curve read again")
    # And a copy half a second old is stale while fewer than YOUNG_CURVE_ENDED have ended, fresh
    # once as many have
    for c, fresh in ((curve([20] * 16), False), (curve([20] * YOUNG_CURVE_ENDED), True)):
        a._curves["r4"] = (time.monotonic() - 0.5, c)
        assert (a.fresh_survival("r4") is c) is fresh


def test_only_the_head_of_the_wait_line_asks_and_leaving_hands_over_the_turn(rclient: redis.Redis) -> None:
    line = adm(rclient).line

    async def go() -> None:
        async with contextlib.AsyncExitStack() as first_stays:
            first = await first_stays.enter_async_context(line.join())
            async with line.join() as second:
                assert first.first() and not second.first()
                await first_stays.aclose()  # the head leaves (admitted, or gave up)
                assert second.first()
        assert line.head() is None

    run_on_worker_loop(go())


def test_interrupted_jobs_wait_ahead_of_new_ones_in_arrival_order(rclient: redis.Redis) -> None:
    line = adm(rclient).line

    async def go() -> None:
        stays: dict[object, contextlib.AsyncExitStack] = {}

        async def join(ahead: bool) -> object:
            stack = contextlib.AsyncExitStack()
            turn = await stack.enter_async_context(line.join(ahead=ahead))
            stays[turn] = stack
            return turn

        new1, new2 = await join(False), await join(False)
        cut1, cut2 = await join(True), await join(True)  # e.g. reaped after their worker died
        order = []
        while (head := line.head()) is not None:  # each leaves once it is the head
            order.append(head)
            await stays[head].aclose()
        assert order == [cut1, cut2, new1, new2]

    run_on_worker_loop(go())


def test_a_head_waiting_for_one_server_steps_back_once_until_room_comes(rclient: redis.Redis) -> None:
    line = adm(rclient).line

    async def go() -> None:
        async with contextlib.AsyncExitStack() as stack:
            a, b, c = [await stack.enter_async_context(line.join()) for _ in range(3)]
            # Given a head refused by its home (a sibling's server) alone: the next job asks
            assert a.step_back() and b.first() and list(line._turns) == [b, a, c]
            assert not a.step_back()  # only the head steps back
            # the next one steps back too: the first that has not (c) asks next
            assert b.step_back() and list(line._turns) == [c, b, a]
            # When the last one steps back there is no one left to pass to: it stays the head
            assert c.step_back() is False and c.first()
            # Then a slot freed here lets everyone ask again, in line order
            line.wake_head()
            await asyncio.sleep(0)
            assert not any(t.passed for t in (a, b, c))
            # and a wake-up a job had when it stepped back is used up by its next wait, not kept
            # (it looped on it behind the head: the worker spun at 94% of a core)
            assert c.first() and c.step_back() and b.first()
            assert c._wake.is_set()
            await c.wait(5.0)
            assert not c._wake.is_set()

    run_on_worker_loop(go())


def test_a_slot_released_from_another_thread_wakes_the_head_at_once_and_leaving_wakes_the_next(
    rclient: redis.Redis,
) -> None:
    a = adm(rclient)
    slot = try_admit(a, "srv", 1000, 900, "short")
    assert slot is not None
    woken: list[str] = []
    first_in = threading.Event()
    next_in = threading.Event()

    async def head() -> None:
        async with a.line.join() as turn:
            turn.arm()
            assert try_admit(a, "srv", 1000, 500, "short") is None
            first_in.set()
            await turn.wait(60)  # a release here must wake it long before this timeout
            woken.append("head")
            while not next_in.is_set():
                await asyncio.sleep(0.01)

    async def behind() -> None:
        while not first_in.is_set():
            await asyncio.sleep(0.01)
        async with a.line.join() as turn:
            next_in.set()
            while not turn.first():
                await turn.wait(60)  # the head leaving must wake it
            woken.append("next")

    loop = LoopThread()
    try:
        jobs = [loop.submit(head()), loop.submit(behind())]
        wait_for(lambda: next_in.is_set(), 10, "the second job to stand in line")
        a.release(slot)  # from this thread, as a task thread settling an error does
        wait_for(lambda: woken == ["head", "next"], 10, "the head, then the next job, to be woken")
        for job in jobs:
            job.result(10)
    finally:
        loop.stop()
