"""The load watch's reads of an unmanaged server (workers/loadwatch.py): ``/v1/loads`` at every
poll, ``/metrics`` (ten times dearer for SGLang's front end) only as often as a retraction may be
news."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import redis

from tests.procs import Proc, sim_stats, start_sim, start_worker, wait_for, worker_env
from tokenmill.admission_view import admission_view
from tokenmill.server_report import Load
from workers.loadwatch import MetricsCadence

ROOM = Load(running=4, waiting=0, used_tokens=500, capacity=4000)


def test_metrics_are_read_at_first_then_every_few_seconds_while_the_pool_has_room() -> None:
    cadence = MetricsCadence(every_s=2.0, tight_use=0.9)
    assert cadence.cached("u", ROOM, now=10.0) is None  # nothing read yet
    cadence.read("u", ROOM, now=10.0, retractions=3)
    assert cadence.cached("u", ROOM, now=10.5) == 3
    assert cadence.cached("u", ROOM, now=11.9) == 3
    assert cadence.cached("u", ROOM, now=12.0) is None
    assert cadence.cached("other", ROOM, now=10.5) is None  # each server its own


def test_metrics_are_read_at_every_poll_while_a_retraction_may_just_have_happened() -> None:
    cadence = MetricsCadence(every_s=2.0, tight_use=0.9)
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
