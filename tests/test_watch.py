"""The process's stream watch (workers/watch.py) on a real redis-server: one batch of heartbeats
(one round trip) for all due streams, stale claims and ``cancel --now`` cut their own streams
only, and deadlines are still enforced while a heartbeat hangs."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import redis

from producer.cancel import cancel_run
from tests.test_ledger import claimed, spec
from tests.trips import TripCounter
from tokenmill import errors
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.ledger_async import AsyncLedger
from tokenmill.redis_async import LoopRedis
from tokenmill.settings import Settings
from tokenmill.transitions import ALIVE, Beat, Checkpoint, Claim, SlotUpdate
from workers.event_loop import run as run_on_worker_loop
from workers.stream import Progress
from workers.watch import AttemptState, Watch, Watched

RUN = "watch"
URL = "http://127.0.0.1:30000"
SETTINGS = Settings.load(env={}, checkpoint_every_s=5.0, checkpoint_every_tokens=256, stall_timeout_s=30.0)


class CountingLedger(AsyncLedger):
    """The real executor; counts the batches it sends."""

    def __init__(self, client: LoopRedis) -> None:
        super().__init__(client)
        self.batches: list[int] = []

    async def calls(self, calls: Sequence[t.Call[Any]]) -> list[Any]:
        self.batches.append(len(calls))
        return await super().calls(calls)


@pytest.fixture
def ledger(rclient: redis.Redis) -> Ledger:
    return Ledger(rclient, RUN)


def _claims(ledger: Ledger, n: int) -> list[Claim]:
    jobs = [spec(i) for i in range(n)]
    ledger.call(t.enqueue(ledger.k, "P", jobs, 100))
    return [claimed(ledger, j) for j in jobs]


def _streaming(tokens: int, at: float) -> AttemptState:
    p = Progress(content=["x"] * tokens, chunks=tokens, first_chunk_at=at, last_chunk_at=at)
    return AttemptState(base=Checkpoint(), progress=p)


async def _watch(redis_url: str, fn) -> None:  # type: ignore[no-untyped-def]
    client = LoopRedis(redis_url)
    try:
        await fn(CountingLedger(client))
    finally:
        client.close()


def test_the_due_heartbeats_of_all_streams_go_in_one_batch(ledger: Ledger, redis_url: str) -> None:
    claims = _claims(ledger, 4)

    async def body(hb: CountingLedger) -> None:
        watch = Watch(SETTINGS, hb, threading.Event())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        streams = [loop.create_future() for _ in claims]
        # three streams are due a checkpoint (5 s passed), the fourth started just now
        ws = [
            watch.add(c, _streaming(10 + i, t0), f, t0, URL)
            for i, (c, f) in enumerate(zip(claims, streams, strict=True))
        ]
        ws[3].started = ws[3].last_renew = ws[3].last_ckpt_at = t0 + 5.5
        watch.tick(t0 + 6)
        beat = ws[0].beat
        assert beat is not None and ws[3].beat is None
        await beat
        assert hb.batches == [3], "one batch carries every due heartbeat"
        for w in ws[:3]:
            assert w.beat is None and w.last_ckpt_at == t0 + 6
            assert w.last_ckpt_tokens == w.state.progress.tokens
            assert w.state.reported_tokens == w.state.progress.tokens
        watch.tick(t0 + 6.5)
        assert ws[0].beat is None, "nothing new is due: no heartbeat"
        for f in streams:
            f.cancel()

    run_on_worker_loop(_watch(redis_url, body))
    for i, c in enumerate(claims[:3]):
        row = ledger.job(c.job_id)
        assert row["ckpt_content"] == "x" * (10 + i) and int(row["ckpt_tokens"]) == 10 + i
    assert not ledger.job(claims[3].job_id).get("ckpt_content")


def test_a_stale_claim_and_cancel_now_stop_only_their_own_streams(
    ledger: Ledger, rclient: redis.Redis, redis_url: str
) -> None:
    stale, cancelled, alive = _claims(ledger, 3)
    stale = dataclasses.replace(stale, token="not-the-owner")
    cancel_run(rclient, RUN, now=True)  # marks every running job; only `cancelled` hears it below
    outcome: dict[str, Watched] = {}

    async def body(hb: CountingLedger) -> None:
        watch = Watch(SETTINGS, hb, threading.Event())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for name, c in (("stale", stale), ("cancelled", cancelled)):
            outcome[name] = watch.add(c, _streaming(3, t0), loop.create_future(), t0, URL)
        watch.tick(t0 + 6)
        await outcome["stale"].beat  # type: ignore[misc]
        rclient.hdel(ledger.k.job(alive.job_id), "cancel")
        outcome["alive"] = watch.add(alive, _streaming(3, t0), loop.create_future(), t0, URL)
        watch.tick(t0 + 12)
        await outcome["alive"].beat  # type: ignore[misc]

    run_on_worker_loop(_watch(redis_url, body))
    assert isinstance(outcome["stale"].error, errors.StaleClaimError)
    assert outcome["stale"].stream.cancelled()
    assert isinstance(outcome["cancelled"].error, errors.JobCancelledError)
    assert outcome["cancelled"].stream.cancelled()
    assert outcome["alive"].error is None and not outcome["alive"].stream.done()
    assert ledger.job(cancelled.job_id)["ckpt_content"] == "xxx", "a cancelled stream is checkpointed first"


def test_deadlines_hold_while_a_heartbeat_hangs(ledger: Ledger, rclient: redis.Redis, redis_url: str) -> None:
    (c,) = _claims(ledger, 1)
    stopping = threading.Event()

    async def body(hb: CountingLedger) -> None:
        watch = Watch(SETTINGS, hb, stopping)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        w = watch.add(c, _streaming(3, t0), loop.create_future(), t0, URL)
        rclient.client_pause(3000)  # Redis holds every client's commands: the heartbeat hangs
        watch.tick(t0 + 6)
        beat = w.beat
        assert beat is not None
        await asyncio.sleep(0.2)
        assert not beat.done(), "the heartbeat is held by the paused Redis"
        watch.tick(t0 + 6 + SETTINGS.stall_timeout_s + 1)  # no chunk for longer than the stall timeout
        assert isinstance(w.error, errors.StreamStalledError)
        assert w.stream.cancelled()
        await watch.drop(w)  # waits for the heartbeat in flight, which lands once Redis resumes
        assert beat.done()

    run_on_worker_loop(_watch(redis_url, body))


def test_the_shutdown_cuts_every_stream(ledger: Ledger, redis_url: str) -> None:
    claims = _claims(ledger, 2)
    stopping = threading.Event()
    watched: list[Watched] = []

    async def body(hb: CountingLedger) -> None:
        watch = Watch(SETTINGS, hb, stopping)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        watched.extend(watch.add(c, _streaming(1, t0), loop.create_future(), t0, URL) for c in claims)
        watch.tick(t0 + 0.5)
        assert not any(w.error for w in watched)
        stopping.set()
        watch.tick(t0 + 1.0)

    run_on_worker_loop(_watch(redis_url, body))
    assert all(isinstance(w.error, errors.ShutdownError) and w.stream.cancelled() for w in watched)


def test_a_request_with_no_first_token_is_cut_once_its_server_fails_its_health_check(
    ledger: Ledger, redis_url: str
) -> None:
    queued, whole, elsewhere, young = _claims(ledger, 4)
    other = "http://127.0.0.1:30001"
    down: set[str] = set()
    watched: dict[str, Watched] = {}

    async def body(hb: CountingLedger) -> None:
        watch = Watch(SETTINGS, hb, threading.Event(), down.__contains__)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for name, c, server in (
            ("queued", queued, URL),
            ("whole", whole, URL),
            ("elsewhere", elsewhere, other),
        ):
            state = AttemptState(base=Checkpoint(), progress=Progress(whole=name == "whole"))  # no chunk yet
            watched[name] = watch.add(c, state, loop.create_future(), t0, server)
        late = t0 + SETTINGS.stall_timeout_s  # sent just before the check below: not yet silent long
        watched["young"] = watch.add(
            young, AttemptState(Checkpoint(), Progress()), loop.create_future(), late, URL
        )
        # no first token for longer than the stall timeout is no fault while the server is healthy
        # (a request queued behind others waits for first_token_timeout_s)
        watch.tick(t0 + SETTINGS.stall_timeout_s + 1)
        assert not any(w.error for w in watched.values())
        # once its server fails its health check, the request silent that long is cut
        down.add(URL)
        watch.tick(t0 + SETTINGS.stall_timeout_s + 2)

    run_on_worker_loop(_watch(redis_url, body))
    for name in ("queued", "whole"):  # an unstreamed request would wait out total_timeout_s
        assert isinstance(watched[name].error, errors.StreamStalledError), name
        assert "health check" in str(watched[name].error)
        assert watched[name].stream.cancelled()
    assert watched["elsewhere"].error is None, "a stream to a healthy server is left alone"
    assert watched["young"].error is None, "a request sent less than stall_timeout_s ago is left alone"


def test_a_heartbeat_that_cannot_be_built_spares_the_other_streams(ledger: Ledger, redis_url: str) -> None:
    broken, fine = _claims(ledger, 2)
    watched: list[Watched] = []

    def unreachable(_: int) -> SlotUpdate:
        raise redis.ConnectionError("Redis is restarting")

    async def body(hb: CountingLedger) -> None:
        watch = Watch(SETTINGS, hb, threading.Event())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        bad = _streaming(3, t0)
        bad.slot_update = unreachable
        watched.append(watch.add(broken, bad, loop.create_future(), t0, URL))
        watched.append(watch.add(fine, _streaming(4, t0), loop.create_future(), t0, URL))
        watch.tick(t0 + 6)
        assert watched[0].beat is None
        await watched[1].beat  # type: ignore[misc]
        assert hb.batches == [1]
        watch.tick(t0 + 6 + SETTINGS.stall_timeout_s + 1)  # both stalled: both cut
        assert all(isinstance(w.error, errors.StreamStalledError) for w in watched)

    run_on_worker_loop(_watch(redis_url, body))
    assert ledger.job(fine.job_id)["ckpt_content"] == "xxxx"


def test_a_batch_is_one_round_trip_and_survives_an_emptied_script_cache(
    ledger: Ledger, rclient: redis.Redis, redis_url: str
) -> None:
    claims = _claims(ledger, 3)
    beats = [Beat(c, Checkpoint("ab", "", 2), 2) for c in claims]

    async def send(hb: CountingLedger) -> None:
        assert await hb.calls([t.heartbeat(b, 30) for b in beats]) == [ALIVE] * 3

    run_on_worker_loop(_watch(redis_url, send))  # loads the script
    with TripCounter(redis_url) as trips:
        run_on_worker_loop(_watch(redis_url, send))
    sent = {name: n for name, n in trips.counts.items() if n and name not in ("hello", "client")}
    assert sent == {"evalsha:heartbeat": 3}, "no SCRIPT EXISTS before the batch"

    rclient.script_flush()  # as after a Redis restart
    run_on_worker_loop(_watch(redis_url, send))
    assert all(ledger.job(c.job_id)["ckpt_content"] == "ab" for c in claims)
