"""Capacity-aware admission: a Redis-wide token budget per server, with per-queue caps."""

from __future__ import annotations

import contextlib
import threading

import redis

from tests.procs import wait_for
from tokenmill.admission import Admission, admission_view
from tokenmill.settings import Settings


def adm(rclient: redis.Redis, **kw: object) -> Admission:
    return Admission(rclient, Settings.load(env={}, admission_fraction=1.0, admission_queue_share=0.75, **kw))


def test_budget_bounds_tokens_in_flight_and_release_frees_room(rclient: redis.Redis) -> None:
    a = adm(rclient)
    s1 = a.try_admit("srv", 1000, 400, "short")
    s2 = a.try_admit("srv", 1000, 300, "long")
    assert s1 and s2
    assert a.try_admit("srv", 1000, 400, "long") is None  # 700 + 400 > 1000
    assert a.load("srv") == 700
    a.release(s1)
    assert a.try_admit("srv", 1000, 400, "long") is not None
    view = admission_view(rclient, "srv")
    assert view["total"] == 700 and view["budget"] == 1000 and view["slots"] == 2 and view["refused"] == 1


def test_a_queue_cannot_take_the_whole_budget_while_the_other_is_active(rclient: redis.Redis) -> None:
    a = adm(rclient)
    assert a.try_admit("srv", 1000, 100, "short")
    assert a.try_admit("srv", 1000, 700, "long")
    assert a.try_admit("srv", 1000, 100, "long") is None  # long's cap is 750 while short runs
    assert a.try_admit("srv", 1000, 100, "short")  # short still has room


def test_an_idle_queues_share_is_not_wasted(rclient: redis.Redis) -> None:
    a = adm(rclient)
    assert a.try_admit("srv", 1000, 700, "long")
    assert a.try_admit("srv", 1000, 250, "long")  # short is idle: long may use the whole budget
    assert a.try_admit("srv", 1000, 100, "short") is None  # no room; short is now waiting...
    assert a.try_admit("srv", 1000, 10, "long") is None  # ...so long is capped again


def test_one_request_is_always_admitted_on_an_idle_server(rclient: redis.Redis) -> None:
    a = adm(rclient)
    assert a.try_admit("srv", 1000, 5000, "short") is not None
    assert a.try_admit("srv", 1000, 1, "short") is None


def test_a_dead_workers_slots_expire(rclient: redis.Redis) -> None:
    a = adm(rclient, lease_ttl_s=0.2)
    assert a.try_admit("srv", 1000, 900, "short")
    assert a.try_admit("srv", 1000, 500, "short") is None
    wait_for(lambda: a.try_admit("srv", 1000, 500, "short"), 5, "the expired slot to free its tokens")
    assert a.load("srv") == 500


def test_unknown_capacity_is_not_limited(rclient: redis.Redis) -> None:
    a = adm(rclient)
    slot = a.try_admit("srv", None, 10**9, "short")
    assert slot is not None and slot.tokens == 0


def test_estimate_uses_the_runs_mean_output_once_known(rclient: redis.Redis) -> None:
    a = adm(rclient, admission_default_output_tokens=1000, admission_output_factor=0.5)
    request = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 5000}
    assert a.estimate("r", request) == 104 + 500
    rclient.hset("tm:r2:stats", "completion_tokens", 2000)
    rclient.hset("tm:r2:counts", "done|P", 10)
    assert a.estimate("r2", request) == 104 + 100
    assert a.estimate("r2", {**request, "max_tokens": 50}) == 104 + 25


def test_only_the_head_of_the_wait_line_asks_and_leaving_hands_over_the_turn(rclient: redis.Redis) -> None:
    line = adm(rclient).line
    with contextlib.ExitStack() as first_stays:
        first = first_stays.enter_context(line.join())
        with line.join() as second:
            assert first.first() and not second.first()
            first_stays.close()  # the head leaves (admitted, or gave up)
            assert second.first()
    assert line.head() is None


def test_a_released_slot_wakes_the_head_at_once_and_leaving_wakes_the_next(rclient: redis.Redis) -> None:
    a = adm(rclient)
    slot = a.try_admit("srv", 1000, 900, "short")
    assert slot is not None
    woken: list[str] = []
    first_in = threading.Event()
    next_in = threading.Event()

    def head() -> None:
        with a.line.join() as turn:
            turn.arm()
            assert a.try_admit("srv", 1000, 500, "short") is None
            first_in.set()
            turn.wait(60)  # a release here must wake it long before this timeout
            woken.append("head")
            next_in.wait(10)

    def behind() -> None:
        first_in.wait(10)
        with a.line.join() as turn:
            next_in.set()
            while not turn.first():
                turn.wait(60)  # the head leaving must wake it
            woken.append("next")

    threads = [threading.Thread(target=head), threading.Thread(target=behind)]
    for t in threads:
        t.start()
    first_in.wait(10)
    wait_for(lambda: next_in.is_set(), 10, "the second thread to stand in line")
    a.release(slot)
    wait_for(lambda: woken == ["head", "next"], 10, "the head, then the next thread, to be woken")
    for t in threads:
        t.join(10)
