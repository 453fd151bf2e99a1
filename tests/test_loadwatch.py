"""The load watch's reads of an unmanaged server (workers/loadwatch.py): ``/v1/loads`` at every
poll, ``/metrics`` (ten times dearer for SGLang's front end) only as often as a retraction may be
news."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import aiohttp
import redis

from tests.procs import Proc, sim_stats, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys
from tokenmill.admission_view import admission_view
from tokenmill.server_report import Load
from tokenmill.settings import Settings
from workers.loadwatch import LoadWatch, MetricsCadence
from workers.runtime import Runtime

ROOM = Load(running=4, waiting=0, used_tokens=500, capacity=4000)


def test_metrics_are_read_at_first_then_every_few_seconds_while_the_pool_has_room() -> None:
    cadence = MetricsCadence()
    assert cadence.cached("u", ROOM, now=10.0) is None  # nothing read yet
    cadence.read("u", ROOM, now=10.0, retractions=3)
    assert cadence.cached("u", ROOM, now=10.5) == 3
    assert cadence.cached("u", ROOM, now=11.9) == 3
    assert cadence.cached("u", ROOM, now=12.0) is None
    assert cadence.cached("other", ROOM, now=10.5) is None  # each server its own


def test_metrics_are_read_at_every_poll_while_a_retraction_may_just_have_happened() -> None:
    cadence = MetricsCadence()
    cadence.read("u", ROOM, now=10.0, retractions=3)
    waiting = ROOM._replace(waiting=1)  # retracted requests wait on the server
    full = ROOM._replace(used_tokens=3600)  # a pool at 90% may overflow before the next figures
    assert cadence.cached("u", waiting, now=10.5) is None
    assert cadence.cached("u", full, now=10.5) is None
    cadence.read("u", full, now=10.5, retractions=4)
    # the poll after tight figures reads too: the overflow may have come between the two
    assert cadence.cached("u", ROOM, now=11.0) is None
    cadence.read("u", ROOM, now=11.0, retractions=5)
    assert cadence.cached("u", ROOM, now=11.5) == 5


def flood(url: str, n: int) -> None:
    """``n`` requests sent to the server at once, past tokenmill: more than its pool holds."""

    async def run() -> None:
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> None:
                body = {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 120}
                async with s.post(f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(run())


def test_an_unmanaged_servers_retractions_reach_the_window_with_few_reads_of_its_metrics(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given an unmanaged sim with /metrics and a 900-token pool, watched by a worker's load watch
    # four times a second
    sim, url = start_sim(
        tmp_path, "--enable-metrics", "--max-total-tokens", "900", "--sim-mean-output-tokens", "400",
        "--sim-step-ms", "10",
    )  # fmt: skip
    procs.append(sim)
    procs.append(start_worker(tmp_path, "short", worker_env(redis_url, url, admission_poll_s=0.25)))

    # When the pool has room (the server idle) for a few seconds
    wait_for(lambda: sim_stats(url)["loads_reads"] >= 12, 30, "a dozen polls")
    idle = sim_stats(url)
    # Then /metrics was read once every 2 s or so, /v1/loads at every poll
    assert idle["metrics_reads"] * 4 <= idle["loads_reads"], idle

    # When requests sent past tokenmill overflow the pool, and the server retracts some
    flood(url, 24)
    busy = sim_stats(url)
    assert busy["retracted_total"] > 0, busy
    # Then /metrics was read at most polls while they ran (requests waited, the pool was full)
    polls = busy["loads_reads"] - idle["loads_reads"]
    reads = busy["metrics_reads"] - idle["metrics_reads"]
    assert reads * 2 >= polls >= 4, (idle, busy)
    # and the window saw every retraction
    wait_for(
        lambda: admission_view(rclient, url).get("srv_retractions") == busy["retracted_total"],
        10, "the retractions in the admission figures",
    )  # fmt: skip


class Reader(LoadWatch):
    """A worker's load watch whose reads of the server are recorded, not made."""

    def __init__(self, name: str, rclient: redis.Redis, poll_s: float) -> None:
        rt = SimpleNamespace(
            worker_id=name,
            settings=Settings.load(env={}, admission_poll_s=poll_s),
            redis=rclient,
            stopping=threading.Event(),
            pool=SimpleNamespace(ready_views=lambda: [SimpleNamespace(name="srv", url="-", managed=False)]),
        )
        super().__init__(cast(Runtime, rt))
        self.reads: list[float] = []

    def _read(self, server: str, url: str, managed: bool) -> None:
        self.reads.append(time.monotonic())


def test_one_watch_at_a_time_reads_a_server_and_another_takes_over_when_its_lease_lapses(
    rclient: redis.Redis,
) -> None:
    # Given two workers' load watches on one server, polling every 0.1 s
    poll_s = 0.1
    first, second = Reader("w1", rclient, poll_s), Reader("w2", rclient, poll_s)
    try:
        first.start()
        wait_for(lambda: first.reads, 5, "the first watch to read")
        second.start()

        # When both poll for a dozen polls
        wait_for(lambda: len(first.reads) >= 12, 10, "a dozen reads")

        # Then only the one holding the lease read the server
        assert second.reads == [] and rclient.get(keys.admission_watch("srv")) == b"w1"

        # When that one stops (its worker died): its lease is renewed no more
        first.rt.stopping.set()
        first.join(5)
        last = first.reads[-1]

        # Then the other reads once the lease has lapsed (three polls), and not before
        wait_for(lambda: second.reads, 5, "the second watch to take over")
        assert second.reads[0] - last >= 2 * poll_s, (last, second.reads[0])
        assert rclient.get(keys.admission_watch("srv")) == b"w2"
    finally:
        for watch in (first, second):
            watch.rt.stopping.set()
            watch.join(5)
