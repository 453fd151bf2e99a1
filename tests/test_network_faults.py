"""Network faults: hosts that vanish without a word, failovers, wrong credentials.

A process killed on this host is answered for by the kernel at once (a reset, a refused
connection); a host that vanishes is not: its connections go silent, never closed, and new ones
are accepted and never answered (``tests.faultproxy.FaultProxy`` in front of Redis or the
server). Every client must notice by its own deadline. Each test ends in an exact export (every
prompt once, byte for byte the sim's text) and bounds the recovery: after a replacement comes
up at the same address, the run moves again within ``RESUME_S``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import kombu
import pytest
import redis

from tests import chaos, sealing
from tests.chaos import Cluster, Workload, prompt_rows
from tests.faultproxy import FaultProxy
from tests.pipeline import cli
from tests.procs import Proc, RedisServer, free_port, spawn, start_sim, wait_for, worker_env
from tests.test_sealing_chaos import aof_file
from tokenmill import keys
from workers.job import ABANDON_AFTER_S
from workers.task import STOP_SLACK_S

OUTAGE_S = 25.0  # how long the host is gone
RESUME_S = 30.0  # progress resumes within this of the replacement
REPLACED_AFTER_S = 20.0  # the server's host is gone this long before a replacement answers
NOTICED_S = 15.0  # ...and the streams to the old one are abandoned within this, with default deadlines
MEAN = 150  # ~1.5 s streams at 10 ms a token: each is checkpointed a few times
STREAMS = ("--reasoning-parser", "qwen3", "--sim-step-ms", "10", "--sim-mean-output-tokens", str(MEAN))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A private redis-server (AOF fsynced on every write: its size marks a point in history),
    the sim, nothing started yet."""
    c = Cluster.start(tmp_path / "cluster", None, STREAMS)
    c.client.config_set("appendfsync", "always")
    yield c
    c.close()


@pytest.fixture
def redis_proxy(cluster: Cluster) -> Iterator[FaultProxy]:
    """Every process of the cluster reaches Redis through this proxy."""
    with FaultProxy(cluster.redis.port) as proxy:
        cluster.redis_via = f"redis://{proxy.address()}/0"
        yield proxy


def streams(run: str, n: int) -> Workload:
    return Workload(run, prompt_rows(run, n), max_tokens=200, mean_output_tokens=MEAN)


def assert_exact(c: Cluster, wl: Workload, out: Path) -> chaos.Audit:
    a = chaos.audit(c, wl, out, timeout=180)
    assert a.problems() == [], "\n".join(a.problems())
    assert a.done == a.exported == a.prompts
    assert c.broken_workers() == [], c.broken_workers()
    return a


def done_count(c: Cluster, run: str) -> int:
    return chaos.state_counts(c.client, run)["done"]


def timed_status(c: Cluster, run: str) -> tuple[float, int, str]:
    """``tokenmill status`` through the cluster's path to Redis: seconds, exit code, output."""
    t0 = time.monotonic()
    res = cli("status", "--run", run, env=c.env, check=False, timeout=120)
    return time.monotonic() - t0, res.returncode, res.stdout + res.stderr


def vanish_then_fail_over(
    c: Cluster, proxy: FaultProxy, run: str, lose_last_s: float = 0.0
) -> tuple[float, dict[str, chaos.JobView]]:
    """Mid-run, Redis's host vanishes for ``OUTAGE_S``, and meanwhile a worker dies; then a
    replacement comes up at the same address: the same Redis, or (``lose_last_s``) one restarted
    from an AOF cut back to what it held that long before the host vanished (a replica that
    missed the last writes). Returns when the replacement is up, and the dead worker's jobs."""
    victim = chaos.busiest_worker(c, run, 2)
    if lose_last_s:  # where the replica's history ends
        aof = aof_file(c.redis)
        cut, cut_at = aof.stat().st_size, time.monotonic()
        wait_for(lambda: time.monotonic() > cut_at + lose_last_s, lose_last_s + 1, "a second of writes")
        assert aof.stat().st_size > cut, "nothing was written in the last second: nothing to lose"
    proxy.vanish()
    gone_at = time.monotonic()
    # while it is gone, `status` says so, clearly, within seconds
    took, code, said = timed_status(c, run)
    assert code != 0 and "cannot reach Redis" in said, said
    assert took < 10, f"status took {took:.1f}s to give up"
    # a worker dies meanwhile: only the reaper, once Redis is back, can give its jobs to another
    victim.kill()
    c.workers.remove(victim)
    if lose_last_s:
        c.redis.kill(signal.SIGKILL)
        os.truncate(aof, cut)
        c.redis.start()
    # its jobs, as the replacement knows them
    held = chaos.running_jobs(c.client, run).items()
    orphans = {j: v for j, v in held if v.worker == chaos.worker_id(victim)}
    assert orphans, "the dead worker held no job"
    wait_for(lambda: time.monotonic() - gone_at >= OUTAGE_S, OUTAGE_S + 5, "the outage to last", 0.5)
    proxy.replace()
    return time.monotonic(), orphans


@pytest.mark.parametrize("replica", ["the same data", "a replica that lost the last second of writes"])
def test_redis_vanishing_for_25s_then_failing_over_loses_nothing_and_the_run_resumes_within_30s(
    tmp_path: Path, cluster: Cluster, redis_proxy: FaultProxy, replica: str
) -> None:
    # Given two workers and a sealer streaming and sealing a run, all through the proxy
    c, run = cluster, "vanish"
    wl = streams(run, 60)
    c.enqueue(wl)
    c.start_workers(2)
    sealer = c.start_sealer(seal_batch_jobs=10, seal_after_s=1, seal_check_s=0.3)

    # When Redis's host vanishes mid-run for 25 s, then fails over to a replacement
    replaced_at, orphans = vanish_then_fail_over(c, redis_proxy, run, 1.0 if "lost" in replica else 0.0)
    done_at_failover = done_count(c, run)

    # Then the reaper puts the dead worker's jobs back (a sealed job keeps no fields: watch closely)
    reaped: set[str] = set()

    def all_reaped() -> bool:
        views = chaos.job_views(c.client, run, set(orphans) - reaped)
        reaped.update(j for j, v in views.items() if v.reaped_ms)
        return reaped == set(orphans)

    wait_for(all_reaped, RESUME_S, f"the dead worker's {len(orphans)} jobs to be reaped", 0.02)
    # and the run moves again within 30 s of the replacement
    wait_for(lambda: done_count(c, run) > done_at_failover, RESUME_S, "a commit after the failover", 0.2)
    resumed_s = time.monotonic() - replaced_at
    # and `status` answers again
    _, code, said = timed_status(c, run)
    assert code == 0, said
    # and every prompt is exported once, byte for byte, with no worker lost on the way
    a = assert_exact(c, wl, tmp_path / "out")
    assert a.continued_jobs > 0, "no job continued from its checkpoint"
    # and the sealer carried on: every result sealed, none twice
    wait_for(lambda: sealing.sealed_count(c.client, run) == len(wl.rows), 60, "every result sealed")
    assert sealer.alive(), sealer.output()[-2000:]
    assert resumed_s < RESUME_S


def test_the_servers_host_vanishing_mid_stream_ends_streams_by_their_stall_deadline_and_jobs_continue(
    tmp_path: Path, cluster: Cluster
) -> None:
    # Given two workers streaming from the sim through a proxy (stall deadline 3 s)
    c, run = cluster, "gpuhost"
    # a lease that outlives the stall and the health probe that follows it (up to 25 s against a
    # host that never answers): the stalled streams are released by their workers, not requeued
    # by the reaper
    c.settings.update(stall_timeout_s=3, lease_ttl_s=40)
    # and a server that runs 12 requests at a time: of the 16 in flight, some wait in its queue,
    # sent and answered with headers but with no first token yet when the host vanishes
    c.replace_sim("--max-running-requests", "12")
    wl = streams(run, 40)
    with FaultProxy(c.sim_port) as proxy:
        c.server_via = f"http://{proxy.address()}"
        c.enqueue(wl)
        c.start_workers(2)
        hit = chaos.wait_mid_stream(c.client, run, 3)

        # When the server's host vanishes mid-stream
        proxy.vanish()

        # Then the streams in flight end by their stall deadline, checkpointed and released, and
        # the requests queued on the server as soon as the server fails its health check (at the
        # first stall's probe, up to 25 s against a host that never answers), not after
        # first_token_timeout_s (an hour); each seen ended once suffices: a released job may be
        # claimed again, and stall again, before the others are released
        seen_ended: set[str] = set()

        def ended() -> bool:
            views = chaos.job_views(c.client, run, set(hit) - seen_ended)
            seen_ended.update(j for j, v in views.items() if v.state != "running" or v.token > hit[j].token)
            return seen_ended == set(hit)

        try:
            wait_for(ended, 3 + 1 + 5 + 25 + 5, "the streams in flight to end by their stall deadline", 0.1)
        except AssertionError as exc:
            left = chaos.job_views(c.client, run, set(hit) - seen_ended)
            logs = "\n".join(w.output()[-3000:] for w in c.workers)
            raise AssertionError(f"{exc}; never seen ended: {left}\n{logs}") from None
        stalled = {j for j, v in chaos.job_views(c.client, run, hit).items() if v.last_error_class == "stall"}
        assert stalled, chaos.job_views(c.client, run, hit)
        why = {c.client.hget(keys.RunKeys(run).job(j), "last_error") for j in stalled}
        assert any(b"no chunk for" in w for w in why if w), why
        assert any(b"no first token" in w and b"health check" in w for w in why if w), why

        # When a replacement server comes up at the same address
        c.replace_sim()
        proxy.replace(c.sim_port)
        replaced_at = time.monotonic()
        done_then = done_count(c, run)

        # Then the run moves again within 30 s, the stalled jobs continuing from their checkpoints
        wait_for(lambda: done_count(c, run) > done_then, RESUME_S, "a commit on the replacement", 0.2)
        assert time.monotonic() - replaced_at < RESUME_S
        a = assert_exact(c, wl, tmp_path / "out")
    assert a.continued_jobs > 0 and a.continued_tokens > 0


@pytest.mark.alone
def test_a_server_replaced_where_its_host_vanished_is_noticed_within_15s_with_the_default_stall_deadline(
    tmp_path: Path, cluster: Cluster
) -> None:
    # Given two workers streaming from the sim through a proxy, with the default deadlines (a
    # stream ends by its stall deadline after 120 s of silence)
    c, run = cluster, "replaced"
    wl = streams(run, 40)
    with FaultProxy(c.sim_port) as proxy:
        c.server_via = f"http://{proxy.address()}"
        c.enqueue(wl)
        c.start_workers(2)
        hit = chaos.wait_mid_stream(c.client, run, 3)

        # When the server's host vanishes for 20 s (its connections left open, never reset), and
        # then a replacement server answers at the same address
        proxy.vanish()
        gone_at = time.monotonic()
        wait_for(lambda: time.monotonic() - gone_at >= REPLACED_AFTER_S, 30, "the outage to last", 0.5)
        done_then = done_count(c, run)
        c.replace_sim()
        proxy.replace(c.sim_port)
        replaced_at = time.monotonic()

        # Then within 15 s the streams to the old server are abandoned and their jobs continue
        # (each seen ended once: a released job may be claimed again at once), and a job is done
        seen_ended: set[str] = set()

        def ended() -> bool:
            views = chaos.job_views(c.client, run, set(hit) - seen_ended)
            seen_ended.update(j for j, v in views.items() if v.state != "running" or v.token > hit[j].token)
            return seen_ended == set(hit)

        wait_for(ended, NOTICED_S, "the streams to the vanished server to be abandoned", 0.1)
        wait_for(lambda: done_count(c, run) > done_then, NOTICED_S, "a commit on the replacement", 0.1)
        took = time.monotonic() - replaced_at
        lost = {
            j for j, v in chaos.job_views(c.client, run, hit).items() if v.last_error_class == "stream_lost"
        }
        assert lost, chaos.job_views(c.client, run, hit)
        a = assert_exact(c, wl, tmp_path / "out")
    assert a.continued_jobs > 0 and a.continued_tokens > 0
    assert took < NOTICED_S


def test_workers_stop_on_sigterm_within_their_grace_while_redis_is_gone(
    cluster: Cluster, redis_proxy: FaultProxy
) -> None:
    # Given a worker streaming a run through the proxy (shutdown grace 3 s)
    c, run = cluster, "sigterm"
    c.enqueue(streams(run, 30))
    worker = c.start_workers(1)[0]
    chaos.wait_mid_stream(c.client, run, 2)

    # When Redis's host vanishes, and then the worker is told to stop
    redis_proxy.vanish()
    worker.signal(signal.SIGTERM)
    t0 = time.monotonic()

    # Then it exits within its grace, plus the jobs' last wait on Redis and Celery's own stop
    grace_s = float(c.env["TOKENMILL_SHUTDOWN_GRACE_S"])
    bound = grace_s + ABANDON_AFTER_S + STOP_SLACK_S + 3  # + the process's exit
    wait_for(lambda: not worker.alive(), bound + 30, "the worker to exit")
    took = time.monotonic() - t0
    c.workers.remove(worker)
    assert took < bound, (
        f"the worker took {took:.1f}s to stop (bound {bound:.0f}s):\n{worker.output()[-3000:]}"
    )


def test_a_wrong_redis_password_is_one_clear_error_within_seconds(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "guarded", password="s3cret").start()
    sim, url = start_sim(tmp_path)
    worker = None
    try:
        env = worker_env(f"redis://:n0t-the-pass@127.0.0.1:{server.port}/0", url)
        t0 = time.monotonic()
        worker = spawn([*chaos_worker_args()], tmp_path / "worker.log", env=env)
        wait_for(lambda: not worker.alive(), 30, "the worker to give up")
        took = time.monotonic() - t0
        out = worker.output()
        assert worker.proc.returncode != 0
        assert out.count("refused the credentials") == 1, out
        assert "n0t-the-pass" not in out, "the password was logged"
        assert took < 15, f"{took:.1f}s to say so"
    finally:
        if worker is not None:
            worker.kill()
        sim.kill()
        server.kill()


def chaos_worker_args() -> list[str]:
    name = f"short-{free_port()}"
    return [sys.executable, "-m", "tokenmill.cli", "worker", "--queue", "short", "--hostname", f"{name}@%h"]


def test_a_wrong_api_key_is_one_clear_error_within_seconds_and_fails_no_job(
    tmp_path: Path, procs: list[Proc]
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    sim, url = start_sim(tmp_path, "--api-key", "right-key")
    try:
        env = worker_env(server.url, url, api_key="wrong-key")
        wl = streams("key", 5)
        cli("enqueue", str(wl.write(tmp_path)), *wl.enqueue_flags, env=env)
        t0 = time.monotonic()
        worker = spawn([*chaos_worker_args()], tmp_path / "worker.log", env=env)
        procs.append(worker)
        wait_for(lambda: "refused the API key" in worker.output(), 30, "the refused key reported")
        took = time.monotonic() - t0
        assert took < 15, f"{took:.1f}s to say so"
        client = redis.Redis.from_url(server.url)
        counts = chaos.state_counts(client, "key")
        assert counts["failed"] == 0 and counts["done"] == 0, counts
        assert worker.output().count("refused the API key") == 1
        assert "wrong-key" not in worker.output()
    finally:
        sim.kill()
        server.kill()


def test_the_brokers_connections_carry_deadlines_and_keepalive(redis_url: str) -> None:
    from tokenmill.app import celery_config
    from tokenmill.settings import Settings

    # Given the Celery configuration a worker starts with
    conf = celery_config(Settings.load(redis_url=redis_url))
    # When kombu opens a channel on it
    with kombu.Connection(conf["broker_url"], transport_options=conf["broker_transport_options"]) as conn:
        channel = conn.default_channel
        kwargs = channel.client.connection_pool.connection_kwargs
        # Then its Redis connections give up on a silent host, and kombu checks its long-lived ones
        assert kwargs["socket_timeout"] == 5.0 and kwargs["socket_connect_timeout"] == 5.0
        assert kwargs["socket_keepalive"] is True
        assert channel.health_check_interval == 10
    assert conf["broker_connection_timeout"] == 5.0
