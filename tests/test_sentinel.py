"""Redis Sentinel: a primary, a replica and a sentinel (real ``redis-server``, ``--sentinel``),
and tokenmill on a ``sentinel://`` URL for everything (the broker, the ledger, the loop's
client). The primary is SIGKILLed mid-run; Sentinel promotes the replica; the run ends exact.
Replication is asynchronous: the writes the replica had not received when the primary died are
lost, as an AOF cut loses them, and the ledger's rules must cover that too.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.sentinel

from tests import chaos
from tests.chaos import Cluster, Workload, prompt_rows
from tests.procs import RedisServer, wait_for
from tokenmill.local_redis import free_port, redis_binary
from tokenmill.redis_async import LoopRedis
from workers.event_loop import run as run_on_worker_loop

MASTER = "tm-primary"
MEAN = 150
STREAMS = ("--reasoning-parser", "qwen3", "--sim-step-ms", "10", "--sim-mean-output-tokens", str(MEAN))
RESUME_S = 30.0


class Replica(RedisServer):
    """A redis-server replicating ``primary`` (AOF on, as the primary)."""

    def __init__(self, workdir: Path, primary: RedisServer) -> None:
        super().__init__(workdir)
        self.primary = primary

    def argv(self) -> list[str]:
        return [*super().argv(), "--replicaof", "127.0.0.1", str(self.primary.port)]


class Sentinel:
    """One ``redis-server --sentinel`` on loopback watching ``primary`` as ``MASTER``."""

    def __init__(self, workdir: Path, primary: RedisServer) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.conf = workdir / "sentinel.conf"  # Sentinel rewrites it as it learns
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {workdir}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary.port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 10000\n"
        )
        log = open(workdir / "sentinel.log", "ab")
        self.proc = subprocess.Popen([redis_binary(), str(self.conf), "--sentinel"], stdout=log, stderr=log)
        self.client = redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)
        wait_for(lambda: self.client.ping(), 20, "the sentinel")

    def primary_port(self) -> int:
        return int(self.client.sentinel_get_master_addr_by_name(MASTER)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Demoted(RedisServer):
    """A redis-server that replicates a primary gone from its port: a replica, as a demoted
    primary is once a failover has moved on without it."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--replicaof", "127.0.0.1", str(free_port())]


def test_the_loops_client_refuses_a_redis_the_sentinels_name_that_is_not_a_master(tmp_path: Path) -> None:
    # Given a sentinel that still names, as the primary, a Redis that is now a replica
    demoted = Demoted(tmp_path / "demoted").start()
    sentinel = Sentinel(tmp_path / "sentinel", demoted)
    url = f"sentinel://127.0.0.1:{sentinel.port}/0?master_name={MASTER}&socket_timeout=2"

    async def write() -> object:
        r = LoopRedis(url)
        try:
            return await r.call("SET", "tm:probe", "1")
        finally:
            r.close()

    # When the worker loop's client writes through the sentinel's URL
    try:
        with pytest.raises(redis.ConnectionError) as refused:
            run_on_worker_loop(write())
    finally:
        sentinel.stop()
        demoted.kill()

    # Then it refuses the connection, saying why, rather than writing to a replica
    assert f"the Redis the sentinels named as {MASTER!r} is not a master" in str(refused.value)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[tuple[RedisServer, Replica, Sentinel]]:
    primary = RedisServer(tmp_path / "primary").start()
    replica = Replica(tmp_path / "replica", primary).start()
    wait_for(
        lambda: replica.client().info("replication").get("master_link_status") == "up",
        20,
        "the replica in sync",
    )
    sentinel = Sentinel(tmp_path / "sentinel", primary)
    wait_for(lambda: sentinel.client.sentinel_slaves(MASTER), 30, "the sentinel to find the replica")
    yield primary, replica, sentinel
    sentinel.stop()
    replica.kill()
    primary.kill()


def test_a_sentinel_failover_mid_run_ends_the_run_exactly_once(
    tmp_path: Path, group: tuple[RedisServer, Replica, Sentinel]
) -> None:
    # Given workers, the producer and a sealer on a sentinel:// URL, streaming a run
    primary, replica, sentinel = group
    c = Cluster.start(tmp_path / "cluster", primary, STREAMS)
    try:
        c.redis_via = f"sentinel://127.0.0.1:{sentinel.port}/0?master_name={MASTER}"
        watcher = redis.sentinel.Sentinel([("127.0.0.1", sentinel.port)], socket_timeout=2)
        c._client = watcher.master_for(MASTER, socket_timeout=5, socket_connect_timeout=1)
        wl = Workload("sentinel", prompt_rows("sentinel", 60), max_tokens=200, mean_output_tokens=MEAN)
        c.enqueue(wl)
        c.start_workers(2)
        c.start_sealer(seal_batch_jobs=10, seal_after_s=1, seal_check_s=0.3)
        chaos.wait_mid_stream(c.client, wl.run, 3)

        # When the primary is SIGKILLed and Sentinel promotes the replica
        primary.kill(signal.SIGKILL)
        wait_for(lambda: sentinel.primary_port() == replica.port, 60, "Sentinel to promote the replica", 0.2)
        promoted_at = time.monotonic()
        # (the test's own client may find no master for a moment while Sentinel settles the flags)
        (done_then,) = wait_for(
            lambda: (chaos.state_counts(c.client, wl.run)["done"],), 10, "the promoted replica readable", 0.2
        )

        # Then the run moves again on the new primary within 30 s
        wait_for(
            lambda: chaos.state_counts(c.client, wl.run)["done"] > done_then,
            RESUME_S,
            "a commit on the promoted replica",
            0.2,
        )
        assert time.monotonic() - promoted_at < RESUME_S
        # and ends with every prompt exported once, byte for byte
        a = chaos.audit(c, wl, tmp_path / "out", timeout=180)
        assert a.problems() == [], "\n".join(a.problems())
        assert a.done == a.exported == a.prompts
        assert c.broken_workers() == [], c.broken_workers()
        # and the workers' loop connections are on the new primary
        names = [x["name"] for x in c.client.client_list()]
        assert sum(n.startswith("tokenmill-loop:") for n in names) == 2, names
    finally:
        c.close()
