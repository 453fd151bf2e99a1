"""The dashboard's history and outputs: who writes the series, what a point holds, how a run's
history, outputs and samples read back through the Python API.

Writers are the real ones: the upkeep's pass (``upkeep_once``), the server manager's sink, the load
watch's point of what a server reported; the last test runs a real worker against the sim.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from server_mgr.reporting import RedisReporter
from tests.finishing import all_job_ids, finish_jobs
from tests.pipeline import cli, write_jsonl
from tests.procs import Proc, start_sim, start_worker, wait_for, worker_env
from tests.test_ledger import spec
from tests.test_series import read
from tokenmill import Client, history, keys, quality, series
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.outputs import RECENT_KEPT
from tokenmill.server_report import Load
from tokenmill.servers import ServerRecord
from tokenmill.settings import Settings
from tokenmill.transitions import Claim, JobError, Judged
from workers.upkeep import Reconciler, upkeep_once


@pytest.fixture
def tm(redis_url: str) -> Client:
    return Client(redis_url=redis_url)


def run_points(client: redis.Redis, run: str) -> list[dict[str, float]]:
    return [fields for _, fields in read(client, keys.RunKeys(run).series())]


def test_the_pump_records_a_moving_run_every_step_and_a_finished_one_only_when_it_changes(
    rclient: redis.Redis,
) -> None:
    # Given a run of four jobs, one done (judged: empty and looping) and one failed, and the
    # upkeep's recorder (step 50 ms)
    ledger = Ledger(rclient, "r1")
    jobs = [spec(i) for i in range(4)]
    ledger.call(t.enqueue(ledger.k, "P", jobs, 100))
    claims = [ledger.call(t.claim(ledger.k, j.job_id, "w", 30)) for j in jobs]
    assert all(isinstance(c, Claim) for c in claims)
    judged = Judged(quality.EMPTY | quality.REPETITION, 200)
    ledger.call(
        t.commit(ledger.k, claims[0], {"content": "x", "usage": {"completion_tokens": 7}}, 7, judged=judged)
    )
    ledger.call(t.fail(ledger.k, claims[1], JobError("context_length", "too long")))
    settings = Settings.load(env={})
    recorder = series.SeriesWriter(rclient, step_s=0.05, keep_s=3600)

    def pass_() -> int:
        return upkeep_once(rclient, settings, Reconciler(), recorder)["recorded"]

    # When the upkeep passes while two jobs still run
    assert pass_() == 1
    wait_for(pass_, 5, "a second point a step later")
    # Then each point holds the run's counts, tokens, failures by class and quality flags
    first = run_points(rclient, "r1")[0]
    assert first == {"queued": 0, "running": 2, "done": 1, "failed": 1, "completion_tokens": 7, "sealed": 0,
                     "shards": 0, "failures:context_length": 1, "judged": 1, "q:empty": 1,
                     "q:repetition": 1}  # fmt: skip
    assert len(run_points(rclient, "r1")) == 2  # a moving run: a point each step, changed or not

    # When the run finishes, a point records it, and then nothing more while it stays still
    for c in claims[2:]:
        ledger.call(t.commit(ledger.k, c, {"content": "y", "usage": {"completion_tokens": 3}}, 3))
    wait_for(pass_, 5, "the finishing point")
    for _ in range(3):
        wait_for(lambda: recorder.due(keys.RunKeys("r1").series()), 5, "a step")
        assert pass_() == 0
    assert run_points(rclient, "r1")[-1]["done"] == 3 and len(run_points(rclient, "r1")) == 3


def test_the_server_manager_records_each_state_change_and_restart(rclient: redis.Redis) -> None:
    sink = RedisReporter(rclient)
    record = ServerRecord(name="s1", url="http://127.0.0.1:1", state="starting", engine="sim")
    for state, restarts in [("starting", 0), ("ready", 0), ("ready", 0), ("down", 0), ("starting", 1),
                            ("ready", 1), ("ready", 1)]:  # fmt: skip
        record.state, record.restarts = state, restarts
        sink.publish(record)  # the supervisor publishes at every change and every heartbeat
    points = [f for _, f in read(rclient, keys.server_states("s1"))]
    names = ["starting", "ready", "down", "starting", "ready"]
    assert [history.server_records.STATES[int(p["state"])] for p in points] == names
    assert [p["restarts"] for p in points] == [0, 0, 0, 1, 1]
    assert rclient.smembers(keys.series_servers()) == {b"s1"}


def test_a_load_point_holds_what_the_server_reported_and_what_admission_made_of_it(
    rclient: redis.Redis,
) -> None:
    rclient.hset(keys.admission_used("s1"), mapping={"n": 12})
    writer = series.SeriesWriter(rclient, step_s=10, keep_s=3600)
    load = Load(running=11, waiting=3, used_tokens=5000, capacity=20000)
    assert history.record_server(writer, rclient, "s1", load, window=14, retractions=2)
    assert not history.record_server(writer, rclient, "s1", load, window=15, retractions=2)  # within a step
    ((_, point),) = read(rclient, keys.server_series("s1"))
    assert point == {"running": 11, "queued": 3, "kv_used": 5000, "kv_capacity": 20000, "window": 14,
                     "in_flight": 12, "retractions": 2}  # fmt: skip


def test_history_reads_the_whole_run_thinned_then_only_what_is_new(tm: Client, rclient: redis.Redis) -> None:
    # Given a run with more points than a read returns, and a server's load during it
    tm.enqueue([{"prompt": "q"}], run="r")
    writer = series.SeriesWriter(rclient, step_s=60, keep_s=3600)
    for i in range(history.MAX_POINTS + 500):
        writer.add(keys.RunKeys("r").series(), {"done": i, "queued": 1}, gap=False)
    load = Load(running=1, waiting=0, used_tokens=10, capacity=100)
    history.record_server(writer, rclient, "s1", load, window=4, retractions=None)

    # When the page reads it whole, then asks for what came after (each read once the Redis
    # clock has left the millisecond of the last point: a read leaves the current one to the next)
    settle(rclient, keys.RunKeys("r").series())
    settle(rclient, keys.server_series("s1"))  # written after the run's points, maybe a millisecond later
    doc = tm.history("r")
    writer.add(keys.RunKeys("r").series(), {"done": 9999, "queued": 0}, gap=False)
    settle(rclient, keys.RunKeys("r").series())
    new = tm.history("r", since_ms=doc["cursor"])

    # Then the whole read is thinned to the limit, ends on the last point, and holds the server
    cols = doc["series"]
    assert len(cols["t"]) <= history.MAX_POINTS and cols["done"][-1] == history.MAX_POINTS + 499
    assert doc["servers"]["s1"]["window"] == [4] and doc["servers"]["s1"]["kv_capacity"] == [100]
    # and the next read only the point added since
    assert new["series"]["done"] == [9999] and new["servers"] == {} and new["since"] == doc["cursor"]


def test_a_read_after_a_cursor_returns_no_point_of_its_millisecond_again(
    tm: Client, rclient: redis.Redis
) -> None:
    # Given a run's three points written in one millisecond (a stream numbers them ms-0, ms-1, ms-2)
    tm.enqueue([{"prompt": "q"}], run="r")
    key = keys.RunKeys("r").series()
    ms = redis_ms(rclient) - 50
    for i in range(3):
        rclient.xadd(key, {"done": i, "queued": 1}, id=f"{ms}-{i}")

    # When the page asks for what came after that millisecond, and after the one before it
    after_it = tm.history("r", since_ms=ms)
    before_it = tm.history("r", since_ms=ms - 1)

    # Then none of them comes again after it, and all three after the one before
    assert after_it["series"].get("done", []) == [], after_it["series"]
    assert before_it["series"]["done"] == [0, 1, 2]


def redis_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def settle(client: redis.Redis, key: str) -> None:
    """Wait until the Redis clock is past the millisecond of ``key``'s last point."""
    last = client.xrevrange(key, count=1)[0][0]
    last_ms = int(last.decode().partition("-")[0])
    wait_for(lambda: redis_ms(client) > last_ms, 2, "the Redis clock to leave the last point's millisecond")


def test_outputs_count_finish_reasons_and_lengths_and_keep_the_latest_jobs(
    tm: Client, rclient: redis.Redis
) -> None:
    # Given 30 jobs committed with the sim's outputs (reasoning on), some cut at max_tokens
    tm.enqueue([{"prompt": f"question {i}"} for i in range(30)], run="r", partition="A", short_max_tokens=60)
    ids = all_job_ids(rclient, "r")
    assert finish_jobs(rclient, "r", mean_output_tokens=40) == 30

    # Then status counts them by finish reason and length
    out = tm.status("r").outputs
    reasons = {}
    for job_id in ids:
        result = rclient.hget(keys.RunKeys("r").job(job_id), "result")
        reasons[job_id] = b'"finish_reason":"length"' in result
    assert out["jobs"] == 30 and sum(out["finish_reasons"].values()) == 30
    assert out["finish_reasons"].get("length", 0) == sum(reasons.values()) > 0
    assert out["truncated_share"] == round(sum(reasons.values()) / 30, 4)
    assert sum(n for _, _, n in out["completion_tokens"]) == 30 and out["reasoning_counted"] == 30
    assert all(lo < hi for lo, hi, _ in out["completion_tokens"])
    # and the partition's recent list holds its latest jobs, newest first, bounded
    recent = [x.decode() for x in rclient.lrange(keys.RunKeys("r").recent("A"), 0, -1)]
    assert recent == ids[::-1][:RECENT_KEPT]


def test_samples_are_export_rows_from_redis_then_from_their_shard_once_sealed(
    tm: Client, rclient: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    tm.enqueue([{"id": f"a{i}", "prompt": f"question {i}"} for i in range(8)], run="r", partition="A")
    tm.enqueue([{"id": f"b{i}", "prompt": f"other {i}"} for i in range(2)], run="r", partition="B")
    finish_jobs(rclient, "r", mean_output_tokens=20)
    exported = {row["id"]: row for row in tm.results("r", include_truncated=True)}

    # While done in Redis: the latest three of A, both of B, as the export writes them
    samples = tm.samples("r", 3)
    shown = [(s["partition"], s["row"]["id"], s["source"]) for s in samples]
    assert shown == [("A", "a7", "redis"), ("A", "a6", "redis"), ("A", "a5", "redis"),
                     ("B", "b1", "redis"), ("B", "b0", "redis")]  # fmt: skip
    assert all(s["row"] == exported[s["row"]["id"]] for s in samples)

    # Once sealed: the same rows, read from the shards
    env = {"TOKENMILL_REDIS_URL": redis_url, "TOKENMILL_RESULTS_URL": str(tmp_path / "store")}
    cli("seal", "--once", "--all", env=env)
    sealed = tm.samples("r", 2, partition="A")
    assert [(s["row"]["id"], s["source"]) for s in sealed] == [("a7", "shard"), ("a6", "shard")]
    assert all(s["row"] == exported[s["row"]["id"]] for s in sealed)

    # A lost shard is named, not raised: the page shows the error in the sample's place
    for shard in (tmp_path / "store").rglob("*.parquet"):
        if "specs" not in shard.parts:
            shard.unlink()
    lost = tm.samples("r", 1, partition="B")
    assert "could not be read" in lost[0]["error"] and "row" not in lost[0]


def test_a_real_worker_records_the_run_and_the_servers_load_and_counts_reasoning(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given the sim (reasoning on, ~1 s a job: the run outlasts several points) and a worker
    # recording a point every half second
    sim, url = start_sim(tmp_path, "--reasoning-parser", "qwen3", "--sim-step-ms", "25")
    procs.append(sim)
    env = worker_env(redis_url, url, series_step_s=0.5)
    procs.append(start_worker(tmp_path, "short", env, concurrency=8))

    # When a run of 40 prompts goes through
    data = write_jsonl(tmp_path / "P.jsonl", [{"prompt": f"question {i}"} for i in range(40)])
    cli("enqueue", str(data), "--run", "live", "--short-max-tokens", "200", env=env)
    tm = Client(redis_url=redis_url)
    wait_for(lambda: tm.status("live").finished, 120, "the run to finish")
    wait_for(lambda: run_points(rclient, "live")[-1]["done"] == 40, 10, "the run's last point")

    # Then its history rose to 40 done, and the server's load was recorded by the load watch
    doc = tm.history("live")
    assert doc["series"]["done"][0] < 40 and doc["series"]["completion_tokens"][-1] > 0
    load = doc["servers"][url]
    assert max(load["running"]) > 0 and min(load["kv_capacity"]) > 0 and min(load["window"]) >= 1
    assert doc["states"] == {}  # no server manager: no state history
    # and every output's reasoning tokens were counted, as SGLang's usage reports them
    out = tm.status("live").outputs
    assert out["jobs"] == 40 and out["reasoning_counted"] == 40
    assert sum(n for _, _, n in out["reasoning_tokens"]) == 40
