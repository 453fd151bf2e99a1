"""Time series in Redis streams (tokenmill/series.py): a point a step whoever writes, bounded, read
back as columns."""

from __future__ import annotations

import itertools

import pytest
import redis

from tests.procs import wait_for
from tokenmill.errors import ConfigError
from tokenmill.series import Point, SeriesWriter, columns, downsample, encode, parse_entry
from tokenmill.settings import Settings


def read(client: redis.Redis, key: str) -> list[Point]:
    """Every point of the series ``key``."""
    return [parse_entry(entry) for entry in client.xrange(key)]


def test_a_series_gets_one_point_a_step_whichever_writer_asks(rclient: redis.Redis) -> None:
    # Given two writers of one series (a lease changing hands) and a step of a minute
    a, b = SeriesWriter(rclient, step_s=60, keep_s=3600), SeriesWriter(rclient, step_s=60, keep_s=3600)

    # When both add points within the step
    assert a.add("s", {"x": 1}) is True
    assert b.add("s", {"x": 2}) is False
    assert a.add("s", {"x": 3}) is False

    # Then the series holds the first only; a writer that asked spares its next round trips for a
    # step, one that never asked does not know and asks
    assert [fields for _, fields in read(rclient, "s")] == [{"x": 1.0}]
    assert not a.due("s") and not b.due("s")
    assert SeriesWriter(rclient, step_s=60, keep_s=3600).due("s")


def test_points_a_step_apart_are_all_kept_in_order(rclient: redis.Redis) -> None:
    w = SeriesWriter(rclient, step_s=0.05, keep_s=3600)
    for i in range(3):
        wait_for(lambda i=i: w.add("s", {"i": i, "half": i / 2}), 5, f"point {i}")
    points = read(rclient, "s")
    assert [f for _, f in points] == [{"i": 0, "half": 0}, {"i": 1, "half": 0.5}, {"i": 2, "half": 1}]
    times = [ms for ms, _ in points]
    assert all(later - earlier >= 45 for earlier, later in itertools.pairwise(times))
    cols = columns(points)
    assert cols["i"] == [0, 1, 2] and cols["t"] == [ms / 1000 for ms in times]


def test_a_series_of_changes_skips_a_point_equal_to_the_last(rclient: redis.Redis) -> None:
    w = SeriesWriter(rclient, step_s=60, keep_s=3600)
    assert w.add("st", {"state": 1, "restarts": 0}, skip_same=True, gap=False, index=("idx", "s1"))
    assert not w.add("st", {"state": 1, "restarts": 0}, skip_same=True, gap=False)
    assert w.add("st", {"state": 3, "restarts": 0}, skip_same=True, gap=False)
    assert w.add("st", {"state": 1, "restarts": 1}, skip_same=True, gap=False)
    assert [f["state"] for _, f in read(rclient, "st")] == [1, 3, 1]
    assert rclient.smembers("idx") == {b"s1"}


def test_points_older_than_the_keep_time_are_trimmed_as_points_are_added(rclient: redis.Redis) -> None:
    # Given a series that keeps a millisecond of points
    w = SeriesWriter(rclient, step_s=60, keep_s=0.001)
    # When a thousand points are added (no gap: each is kept until it is a millisecond old)
    for i in range(1000):
        w.add("s", {"i": i}, gap=False)
    # Then whole stream nodes of old points are gone (approximate trimming keeps at most a node
    # of 100 past the limit, and the node being filled)
    assert rclient.xlen("s") <= 200
    assert read(rclient, "s")[-1][1] == {"i": 999}


def test_values_encode_the_same_when_equal() -> None:
    assert encode(3.0) == "3" and encode(3) == "3" and encode(0.1234567) == "0.123457"
    assert encode(1 / 3) == encode(0.33333333)


def test_downsampling_keeps_counters_last_and_gauges_peak() -> None:
    points = [(i * 1000, {"done": i, "running": i % 4, "failures:x": i // 2}) for i in range(10)]
    thin = downsample(points, 3, counters=("done", "failures"))
    assert len(thin) == 3
    assert [t for t, _ in thin] == [3000, 7000, 9000]
    assert [f["done"] for _, f in thin] == [3, 7, 9]  # the last of each group
    assert [f["failures:x"] for _, f in thin] == [1, 3, 4]
    assert [f["running"] for _, f in thin] == [3, 3, 1]  # the peak of each group
    assert downsample(points, 10) is points


def test_settings_refuse_a_keep_time_shorter_than_a_step() -> None:
    assert Settings.load(env={}).series_step_s == 10 and Settings.load(env={}).series_keep_s == 7 * 86400
    with pytest.raises(ConfigError, match="series_keep_s"):
        Settings.load(env={"TOKENMILL_SERIES_STEP_S": "60", "TOKENMILL_SERIES_KEEP_S": "30"})
    with pytest.raises(ConfigError, match="series_step_s"):
        Settings.load(env={"TOKENMILL_SERIES_STEP_S": "0"})
