"""History: the Redis bytes the dashboard's time series cost per day, and a point's write cost.

A private redis-server (AOF on, as tokenmill runs it) receives a day of each series at the default
step (``series_step_s`` 10: 8,640 points) in the format ``series.lua`` writes (fields sorted,
values as :func:`tokenmill.series.encode` spells them, entry ids 10 s apart on the Redis clock),
with values of the sizes a long run has (tens of thousands of jobs, hundreds of millions of
tokens, two failure classes); then seven days (the default ``series_keep_s``), the most a series
holds. Bytes are ``MEMORY USAGE <key> SAMPLES 0`` (the whole stream). The write cost is the time
of ``SeriesWriter.add`` (one ``EVALSHA`` of ``series.lua``) over 10,000 points.

    .venv/bin/python bench/series.py
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import redis

from tokenmill import history
from tokenmill.local_redis import LocalRedis
from tokenmill.series import SeriesWriter, encode
from tokenmill.server_report import Load

DAY_POINTS = 86400 // 10
WEEK_POINTS = 7 * DAY_POINTS


def run_point(i: int, rng: random.Random) -> dict[str, float]:
    done = min(88_000, i * 2)
    return {
        "queued": max(0, 88_000 - done - 180),
        "running": 180 if done < 88_000 else 0,
        "done": done,
        "failed": i // 500,
        "cancelled": 0,
        "completion_tokens": done * 4000 + rng.randrange(4000),
        "sealed": (done // 1000) * 1000,
        "shards": done // 1000,
        "failures:context_length": i // 600,
        "failures:invalid_request": i // 2000,
    }


def server_point(i: int, rng: random.Random) -> dict[str, float]:
    load = Load(
        running=rng.randrange(120, 180),
        waiting=rng.randrange(0, 20),
        used_tokens=rng.randrange(120_000, 159_000),
        capacity=159_000,
    )
    return history.server_point(load, window=rng.randrange(150, 200), retractions=i // 300, in_flight=175)


def fill(client: redis.Redis, key: str, points: int, make: object, step_ms: int = 10_000) -> None:
    """``points`` entries 10 s apart, as series.lua writes them."""
    rng = random.Random(7)
    start = int(time.time() * 1000) - points * step_ms
    pipe = client.pipeline(transaction=False)
    for i in range(points):
        fields = make(i, rng)  # type: ignore[operator]
        pipe.xadd(key, {name: encode(fields[name]) for name in sorted(fields)}, id=f"{start + i * step_ms}-0")
        if len(pipe) >= 1000:
            pipe.execute()
    pipe.execute()


def usage(client: redis.Redis, key: str) -> int:
    return int(client.memory_usage(key, samples=0) or 0)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rds = LocalRedis(Path(tmp)).start()
        try:
            client = redis.Redis.from_url(rds.url)
            rows = []
            for name, make in (("a run's", run_point), ("a server's load", server_point)):
                for days, points in ((1, DAY_POINTS), (7, WEEK_POINTS)):
                    key = f"bench:{name}:{days}"
                    fill(client, key, points, make)
                    rows.append((name, days, points, usage(client, key)))
            changes = 50  # a server's state: a point per change (a restart is 3 changes)
            fill(client, "bench:state", changes, lambda i, rng: {"state": i % 5, "restarts": i // 3})
            state_bytes = usage(client, "bench:state")
            writer = SeriesWriter(client, step_s=10, keep_s=7 * 86400)
            point = server_point(0, random.Random(1))
            n = 10_000
            t0 = time.perf_counter()
            for _ in range(n):
                writer.add("bench:write", point, gap=False)
            write_us = (time.perf_counter() - t0) / n * 1e6
        finally:
            rds.stop()
    print(f"{'series':<18} {'days':>4} {'points':>7} {'bytes':>10} {'bytes/point':>11} {'bytes/day':>10}")
    for name, days, points, size in rows:
        print(f"{name:<18} {days:>4} {points:>7} {size:>10,} {size / points:>11.1f} {size / days:>10,.0f}")
    print(f"{'a state series':<18} {'':>4} {changes:>7} {state_bytes:>10,} {state_bytes / changes:>11.1f}")
    print(f"writing a point (SeriesWriter.add, one EVALSHA): {write_us:.0f} us")


if __name__ == "__main__":
    main()
