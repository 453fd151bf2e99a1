"""Sealing under faults: the sealer killed at each step of the protocol, Redis SIGKILLed (and made
to forget its last writes) during sealing, a shard deleted under a live pipeline. After each, the
export holds every distinct prompt exactly once, byte for byte the export taken before anything
was sealed (or names the lost shard, and ``tokenmill repair`` brings it back).

The sealer is a real ``tokenmill seal`` process; ``--crash-at STEP`` makes it SIGKILL itself at
that step (its fault hook). Redis is a real redis-server restarted from its AOF.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import redis

from producer.sealing import MARK_CHUNK, STEPS
from tests import sealing
from tests.finishing import all_job_ids
from tests.pipeline import cli, expected_for, read_export, wait_run_finished
from tests.procs import Proc, RedisServer, spawn, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys

ROWS = 2 * MARK_CHUNK + 100  # one shard, marked in three chunks: "half_marked" falls between two


def sealer_crash(env: dict[str, str], step: str) -> None:
    out = sealing.crash_sealer(env, step)
    assert out == "killed", f"the sealer did not die at {step}: {out}"


def assert_all_sealed_once(client: redis.Redis, run: str, store: Path, jobs: int) -> None:
    """Every job sealed, no seal half done, no temporary file left."""
    k = keys.RunKeys(run)
    assert sealing.job_states(client, run) == {"sealed": jobs}
    assert sealing.sealed_count(client, run) == jobs
    assert client.scard(k.seals_pending()) == 0
    assert list(store.rglob("*.tmp")) == []


@pytest.mark.parametrize("step", STEPS)
def test_a_sealer_killed_at_any_step_leaves_every_result_exported_once_and_the_next_pass_completes_it(
    tmp_path: Path, rclient: redis.Redis, redis_url: str, step: str
) -> None:
    # Given 600 done jobs due as one shard, and their export
    store = tmp_path / "store"
    env = sealing.sealing_env(redis_url, store, seal_batch_jobs=ROWS)
    assert sealing.done_run(tmp_path, rclient, env, "r", {"P": ROWS}) == ROWS
    before = sealing.export(env, "r", tmp_path / "before")

    # When the sealer is SIGKILLed at this step of the protocol
    sealer_crash(env, step)
    k = keys.RunKeys("r")
    assert rclient.scard(k.seals_pending()) == 1  # the manifest was recorded first
    states = sealing.job_states(rclient, "r")
    assert states == (
        {"sealed": MARK_CHUNK, "done": ROWS - MARK_CHUNK} if step == "half_marked" else {"done": ROWS}
    )

    # Then the export still holds every prompt exactly once, byte for byte
    assert sealing.export(env, "r", tmp_path / "crashed") == before
    # and the next sealer's pass completes the shard, leaving nothing half done
    assert "completed 1 half-done seal(s)" in sealing.seal(env)
    assert_all_sealed_once(rclient, "r", store, ROWS)
    assert len(list((store / "r" / "P").glob("*.parquet"))) == 1
    assert sealing.export(env, "r", tmp_path / "after") == before


def aof_file(server: RedisServer) -> Path:
    """The file Redis appends to (7.x: the newest incr file of appendonlydir; 6.x: one file)."""
    multi = sorted(server.workdir.glob("appendonlydir/*.incr.aof"), key=lambda p: p.stat().st_mtime)
    return multi[-1] if multi else server.workdir / "appendonly.aof"


@pytest.fixture
def own_redis(tmp_path: Path) -> RedisServer:
    """A private redis-server that fsyncs every write (so the AOF's size marks a point in
    history exactly); killed at the end of the test."""
    server = RedisServer(tmp_path / "redis").start()
    server.client().config_set("appendfsync", "always")
    yield server  # type: ignore[misc]
    server.kill()


@pytest.mark.parametrize("lost", ["the whole seal", "the marks", "nothing"])
def test_redis_killed_during_sealing_and_forgetting_its_last_writes_keeps_every_result_exactly_once(
    tmp_path: Path, own_redis: RedisServer, lost: str
) -> None:
    # Given 600 done jobs on a redis-server with its AOF, and their export
    store = tmp_path / "store"
    client = own_redis.client()
    env = sealing.sealing_env(own_redis.url, store, seal_batch_jobs=ROWS)
    sealing.done_run(tmp_path, client, env, "r", {"P": ROWS})
    before = sealing.export(env, "r", tmp_path / "before")
    aof = aof_file(own_redis)

    # When sealing runs (a sealer dying half way through the marks, or after the file, or not at
    # all), Redis is SIGKILLed, and comes back from an AOF that lost the writes after a point
    if lost == "the whole seal":  # Redis forgets the manifest and the marks; the file stays
        cut = aof.stat().st_size
        sealing.seal(env)
    elif lost == "the marks":  # Redis forgets the marks a second sealer made after the file
        sealer_crash(env, "shard_written")
        cut = aof.stat().st_size
        sealing.seal(env)
    else:  # the sealer and Redis die while the marks are half done
        sealer_crash(env, "half_marked")
        cut = aof.stat().st_size
    k = keys.RunKeys("r")
    if lost != "nothing":  # what Redis is to forget: a seal it had completed
        assert (sealing.job_states(client, "r"), client.scard(k.seals_pending())) == ({"sealed": ROWS}, 0)
    own_redis.kill(signal.SIGKILL)
    os.truncate(aof, cut)
    own_redis.start()

    # Then Redis really forgot: the jobs' states and pending seals are those of the cut (the whole
    # seal: none begun; the marks: the crashed sealer's manifest pending, no job marked)
    forgotten = {
        "the whole seal": ({"done": ROWS}, 0),
        "the marks": ({"done": ROWS}, 1),
        "nothing": ({"sealed": MARK_CHUNK, "done": ROWS - MARK_CHUNK}, 1),
    }[lost]
    assert (sealing.job_states(client, "r"), client.scard(k.seals_pending())) == forgotten
    # and right after the restart the export is the same, every prompt once
    assert sealing.export(env, "r", tmp_path / "restarted") == before
    # and a sealer's pass seals every job exactly once (a file Redis forgot is never read)
    sealing.seal(env)
    assert_all_sealed_once(client, "r", store, ROWS)
    assert sealing.export(env, "r", tmp_path / "after") == before
    files = len(list((store / "r" / "P").glob("*.parquet")))
    assert files == (2 if lost == "the whole seal" else 1)


def test_a_sealer_loop_rides_through_a_redis_sigkill_mid_run(tmp_path: Path, procs: list[Proc]) -> None:
    # Given 3,000 done jobs sealed in 30 shards by a `tokenmill seal` loop, and their export
    server = RedisServer(tmp_path / "redis").start()
    client = server.client()
    store = tmp_path / "store"
    env = sealing.sealing_env(server.url, store, seal_batch_jobs=100, seal_check_s=0.2)
    try:
        sealing.done_run(tmp_path, client, env, "r", {"P": 3000})
        before = sealing.export(env, "r", tmp_path / "before")
        procs.append(spawn([sys.executable, "-m", "tokenmill.cli", "seal"], tmp_path / "seal.log", env=env))

        # When Redis is SIGKILLed as soon as the first shard is sealed, and restarted 1 s later
        wait_for(lambda: sealing.sealed_count(client, "r") > 0, 60, "the first shard", every=0.005)
        server.kill(signal.SIGKILL)
        quick = redis.Redis.from_url(server.url, socket_connect_timeout=1)
        server.start()
        at_restart = sealing.sealed_count(quick, "r")
        assert at_restart < 3000, "the sealer finished before Redis was killed: nothing was tested"

        # Then the loop carries on and seals every job exactly once
        wait_for(lambda: sealing.sealed_count(client, "r") == 3000, 120, "every job to be sealed")
        wait_for(lambda: client.scard(keys.RunKeys("r").seals_pending()) == 0, 30, "no seal half done")
        assert procs[-1].alive(), procs[-1].output()
        assert_all_sealed_once(client, "r", store, 3000)
        assert sealing.export(env, "r", tmp_path / "after") == before
    finally:
        server.kill()


def test_a_shard_deleted_under_a_live_pipeline_on_s3_is_named_then_repaired_and_generated_again(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc], s3_env: dict[str, str]
) -> None:
    # Given workers and the sim generating a run while a `tokenmill seal` loop seals it into a
    # bucket of a real S3-compatible server
    import fsspec

    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("tm-e2e")
    sim, url = start_sim(
        tmp_path, "--reasoning-parser", "qwen3", "--sim-mean-output-tokens", str(sealing.MEAN)
    )
    procs.append(sim)
    env = {**worker_env(redis_url, url), **s3_env, "TOKENMILL_RESULTS_URL": "s3://tm-e2e/results",
           "TOKENMILL_SEAL_BATCH_JOBS": "50", "TOKENMILL_SEAL_CHECK_S": "0.3"}  # fmt: skip
    sealing.enqueue_run(tmp_path, env, "e2e", {"B1": 200, "B2": 100})
    procs.append(start_worker(tmp_path, "short", env, concurrency=16))
    procs.append(start_worker(tmp_path, "long", env, concurrency=4))
    procs.append(spawn([sys.executable, "-m", "tokenmill.cli", "seal"], tmp_path / "seal.log", env=env))
    wait_run_finished(rclient, "e2e", 150)
    wait_for(lambda: sealing.sealed_count(rclient, "e2e") == 300, 60, "every result sealed")

    # Then the export, read from S3, holds every prompt once with the sim's exact text
    first = sealing.export(env, "e2e", tmp_path / "first")
    assert sealing.prompts_once(first) == dict.fromkeys(sealing.prompts_once(first), 1)
    for rows in read_export(tmp_path / "first").values():
        for row in rows:
            want = expected_for(
                row, max_tokens=sealing.MAX_TOKENS, reasoning=True, mean_output_tokens=sealing.MEAN
            )
            assert row["messages"][-1]["content"] == want.content
    assert sum(len(r) for r in read_export(tmp_path / "first").values()) == 300

    # When one shard object is deleted from the bucket
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    victim = sorted(fs.glob("tm-e2e/results/e2e/B1/*.parquet"))[0]
    fs.rm(victim)
    shard_id = victim.rsplit("/", 1)[1].removesuffix(".parquet")

    # Then the export names it (its s3:// path and its jobs)
    res = cli("export", "--run", "e2e", "--out", str(tmp_path / "lost"), env=env, check=False)
    assert res.returncode == 2 and f"s3://{victim} is missing" in res.stderr, res.stderr
    # and repair puts its jobs back, the workers generate them again, the sealer seals them
    out = cli("repair", "--run", "e2e", env=env).stdout
    assert f"shard {shard_id}:" in out and "50 job(s) put back to queued" in out, out
    wait_run_finished(rclient, "e2e", 120)
    wait_for(lambda: sealing.sealed_count(rclient, "e2e") == 300, 60, "the repaired jobs sealed again")
    assert sealing.export(env, "e2e", tmp_path / "again") == first

    # And `delete --results` removes the run's objects and keys
    for p in procs[1:]:
        p.stop()
    cli("delete", "--run", "e2e", "--results", env=env)
    assert fs.glob("tm-e2e/results/e2e/**") == [] and list(rclient.scan_iter(match="tm:e2e:*")) == []
    assert all_job_ids(rclient, "e2e") == []
