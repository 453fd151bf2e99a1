"""What the dashboard's time series hold, who writes them, and a run's history read back.

Three kinds of series (:mod:`tokenmill.series`), each written by a process that already runs,
one writer at a time:

============== ========================= =========================== ==================================
series         key                       writer                      a point
============== ========================= =========================== ==================================
a run's        ``tm:{run}:series``       the upkeep (its lock), each   jobs by state, completion tokens,
                                         pass                        sealed jobs, shards,
                                                                     ``failures:<class>`` (every job
                                                                     that ended failed with it),
                                                                     ``judged`` jobs and ``q:<flag>``
                                                                     (those with a quality flag)
a server's     ``tm:_:server:{n}:series`` the worker holding the     running and queued requests, KV
load                                     server's load watch         tokens used and capacity,
                                                                     retractions, the admission window
                                                                     and tokenmill's requests in flight
a server's     ``tm:_:server:{n}:states`` its server manager, on     state (index in
state                                    every publish               ``servers.STATES``), restarts
============== ========================= =========================== ==================================

A run's series gets a point every step while jobs are queued or running, and afterwards only
when something changed (a retry, a seal); a server's load one every step while it is ready; a
state series one at each change. Every series keeps ``series_keep_s`` (default 7 days).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from tokenmill import keys, series
from tokenmill import servers as server_records
from tokenmill.replies import text

if TYPE_CHECKING:
    import redis

    from tokenmill.server_report import Load
    from tokenmill.servers import ServerRecord

RUN_COUNTERS = (
    "done",
    "failed",
    "cancelled",
    "completion_tokens",
    "sealed",
    "shards",
    "failures",
    "judged",
    "q",
)
SERVER_COUNTERS = ("retractions", "kv_capacity")
FAILURES = "failures:"  # run-series field prefix: failures:<class>
JUDGED, FLAGGED = "judged", "q:"  # run-series fields: judged jobs, q:<flag> (tokenmill.quality.SIGNALS)
MAX_POINTS = 1500  # a history read of a whole run is thinned to this many points a series
MARGIN_MS = 60_000  # servers' points read this long around a run's span


# -- writing --------------------------------------------------------------------------------


def run_point(client: redis.Redis, run: str) -> tuple[dict[str, float], bool]:
    """The run's point now, and whether it is moving (jobs queued or running)."""
    k = keys.RunKeys(run)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(k.counts())
    pipe.hget(k.stats(), "completion_tokens")
    pipe.hgetall(k.failures())
    pipe.hgetall(k.retried())
    pipe.hvals(k.sealed())
    pipe.smembers(k.partitions())
    pipe.hgetall(k.quality())
    counts, tokens, failed_now, retried, sealed, partitions, quality = pipe.execute()
    pipe = client.pipeline(transaction=False)
    for partition in partitions:
        pipe.scard(k.shards(text(partition)))
    shards = pipe.execute()
    point = Counter(dict.fromkeys((*keys.STATES, JUDGED), 0))
    for field, n in counts.items():
        point[keys.split_count_field(text(field))[0]] += int(n)
    point["completion_tokens"] = int(tokens or 0)
    point["sealed"] = sum(int(n) for n in sealed)
    point["shards"] = sum(shards)
    for hash_ in (failed_now, retried):  # failed now, and failed before `retry` sent them back
        for cls, n in hash_.items():
            point[FAILURES + text(cls)] += int(n)
    for field, n in quality.items():  # <partition>|judged, <partition>|<flag>
        flag = text(field).rpartition(keys.FIELD_SEP)[2]
        point[JUDGED if flag == JUDGED else FLAGGED + flag] += int(n)
    return dict(point), point["queued"] + point["running"] > 0


def record_run(writer: series.SeriesWriter, client: redis.Redis, run: str) -> bool:
    """Add the run's point if one is due (the upkeep, under its lock); whether one was added."""
    key = keys.RunKeys(run).series()
    if not writer.due(key):
        return False
    point, moving = run_point(client, run)
    return writer.add(key, point, skip_same=not moving)


def server_point(load: Load, window: int, retractions: int | None, in_flight: int) -> dict[str, float]:
    """A server's load point: what it reports, and what admission makes of it."""
    point: dict[str, float] = {
        "running": load.running,
        "queued": load.waiting,
        "kv_used": load.used_tokens,
        "kv_capacity": load.capacity,
        "window": window,
        "in_flight": in_flight,
    }
    if retractions is not None:
        point["retractions"] = retractions
    return point


def record_server(
    writer: series.SeriesWriter,
    client: redis.Redis,
    server: str,
    load: Load,
    window: int,
    retractions: int | None,
) -> bool:
    """Add a server's load point if one is due (the worker holding its load watch)."""
    key = keys.server_series(server)
    if not writer.due(key):
        return False
    in_flight = int(client.hget(keys.admission_used(server), "n") or 0)
    point = server_point(load, window, retractions, in_flight)
    return writer.add(key, point, index=(keys.series_servers(), server))


def record_state(writer: series.SeriesWriter, record: ServerRecord) -> bool:
    """Add a point to the server's state series when its state or restarts changed (its manager,
    on every publish)."""
    state = record.state if record.state in server_records.STATES else server_records.DOWN
    point = {"state": server_records.STATES.index(state), "restarts": record.restarts}
    return writer.add(
        keys.server_states(record.name),
        point,
        skip_same=True,
        gap=False,
        index=(keys.series_servers(), record.name),
    )


# -- reading --------------------------------------------------------------------------------


def run_history(client: redis.Redis, run: str, since_ms: int | None = None) -> dict[str, Any]:
    """The run's series and its servers', as columns (``t`` in unix seconds): everything since
    the run began (thinned to :data:`MAX_POINTS` a series), or only the points after
    ``since_ms`` (a page asking for what is new: pass the previous answer's ``cursor``).

    The answer holds the points of whole milliseconds up to ``cursor``, the millisecond before
    the Redis clock's now: a point can still be written in the current one, and the next read
    starts after ``cursor``, so no point comes twice and none is skipped."""
    k = keys.RunKeys(run)
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.hmget(k.stats(), ["first_enqueue_ms", "last_activity_ms"])
    pipe.smembers(keys.series_servers())
    (sec, usec), (first, last), names = pipe.execute()
    cursor = int(sec) * 1000 + int(usec) // 1000 - 1
    run_raw = client.xrange(k.series(), series.after(since_ms) if since_ms is not None else "-", str(cursor))
    run_points = [series.parse_entry(e) for e in run_raw or ()]  # None only in redis-py's type
    last_point = run_points[-1][1] if run_points else {}
    moving = last_point.get("queued", 0) + last_point.get("running", 0) > 0
    start = since_ms if since_ms is not None else int(first or cursor) - MARGIN_MS
    end = cursor if moving or not last else min(cursor, int(last) + MARGIN_MS)
    servers, states = _servers(client, sorted(text(n) for n in names), start, end, since_ms is None)
    if since_ms is None:
        run_points = series.downsample(run_points, MAX_POINTS, RUN_COUNTERS)
    return {
        "run": run,
        "cursor": cursor,
        "since": since_ms,
        "series": series.columns(run_points),
        "servers": servers,
        "states": states,
        "state_names": list(server_records.STATES),
    }


def _servers(
    client: redis.Redis, names: list[str], start: int, end: int, whole: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each server's load points and state points after ``start`` up to ``end`` (whole
    milliseconds); a state series also gives the point it held when the range starts (it
    changes rarely)."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.xrange(keys.server_series(name), series.after(start), str(end))
        pipe.xrange(keys.server_states(name), series.after(start), str(end))
        pipe.xrevrange(keys.server_states(name), str(start), "-", count=1)
    replies = pipe.execute()
    loads: dict[str, Any] = {}
    states: dict[str, Any] = {}
    for i, name in enumerate(names):
        load_raw, state_raw, before = replies[3 * i : 3 * i + 3]
        points = [series.parse_entry(e) for e in load_raw]
        if whole:
            points = series.downsample(points, MAX_POINTS, SERVER_COUNTERS)
        if points:
            loads[name] = series.columns(points)
        changes = [series.parse_entry(e) for e in (before if whole else []) + state_raw]
        if changes:
            states[name] = series.columns(changes)
    return loads, states
