"""The broker stays bounded for big datasets; status shows a run's state to a person."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import redis

from producer.status import run_status
from tests.keyspace import key_events
from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import ROOT, Proc, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys


@dataclass
class BrokerDepth:
    """A broker list's length after every change to it, replayed from its keyspace events.

    The feeder pushes one message per command; each worker delivery pops one. What does not
    fit is kept in ``odd`` (``wait_for`` would swallow an assertion raised while polling).
    """

    depth: int
    peak: int = 0
    pushes: int = 0
    pops: int = 0
    odd: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.peak = self.depth

    def replay(self, events: list[tuple[str, str]]) -> None:
        for _key, event in events:
            if event in ("lpush", "rpush"):
                self.depth += 1
                self.pushes += 1
            elif event in ("lpop", "rpop"):
                self.depth -= 1
                self.pops += 1
            elif event != "del":
                self.odd.append(f"unexpected change to the broker list: {event}")
            if self.depth < 0 or (event == "del" and self.depth != 0):
                self.odd.append(f"the events do not add up (several pushed at once?) after {event}")
            self.peak = max(self.peak, self.depth)


def _enqueue_bounded(
    tmp_path: Path, redis_url: str, procs: list[Proc]
) -> tuple[dict[str, str], subprocess.CompletedProcess[str]]:
    """A sim, and 300 prompts enqueued as run ``r`` with at most 25 messages in the broker."""
    sim, url = start_sim(tmp_path, "--sim-mean-output-tokens", "10")
    procs.append(sim)
    env = worker_env(redis_url, url, max_queued=25)
    data = write_jsonl(tmp_path / "P.jsonl", [{"prompt": f"q{i}"} for i in range(300)])
    return env, cli("enqueue", str(data), "--run", "r", "--max-queued", "25", env=env)


def test_max_queued_bounds_the_broker_and_the_feeder_publishes_the_rest(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    env, res = _enqueue_bounded(tmp_path, redis_url, procs)
    assert "300 new" in res.stdout and "275 held in the ledger's backlog" in res.stdout
    assert rclient.llen("short") == 25
    with key_events(rclient, "short") as events:
        # nothing consumes or feeds before the worker starts: the trace starts from an exact depth
        broker = BrokerDepth(rclient.llen("short"))
        procs.append(start_worker(tmp_path, "short", env, concurrency=4))
        wait_for(
            lambda: broker.replay(events.read()) or rclient.llen("tm:r:backlog:short") == 0,
            60,
            "the feeder to drain the backlog",
        )
        assert wait_run_finished(rclient, "r", 60)["totals"]["done"] == 300
        wait_for(lambda: broker.replay(events.read()) or broker.depth == 0, 10, "the last pops' events")
    # Then the broker list never held more than 25 messages, after any single change to it
    assert not broker.odd, broker
    assert broker.peak <= 25, f"the broker list reached {broker.peak} messages"
    assert broker.pushes >= 275 and broker.pops >= 300, broker  # the trace saw the feeder at work
    assert rclient.llen("short") == 0


def test_resume_keeps_the_broker_bounded_and_leaves_waiting_jobs_to_the_feeder(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given 300 jobs enqueued with at most 25 messages in the broker (275 on the backlog)
    env, _ = _enqueue_bounded(tmp_path, redis_url, procs)

    # When the broker list is lost and the run resumed
    rclient.delete("short")
    line = cli("resume", "--run", "r", "--max-queued", "25", env=env).stdout
    # Then only the 25 jobs that had a message get one again; the backlog is left to the feeder
    assert "republished 25 queued jobs" in line and "275 were already waiting" in line, line
    assert rclient.llen("short") == 25 and rclient.llen("tm:r:backlog:short") == 275

    # When the backlog is lost as well and the run resumed
    rclient.delete("short", "tm:r:backlog:short")
    line = cli("resume", "--run", "r", "--max-queued", "25", env=env).stdout
    # Then every job is handed back, and still only 25 of them as messages
    assert "republished 300 queued jobs" in line, line
    assert "275 of the republished wait on the backlog" in line, line
    assert rclient.llen("short") == 25 and rclient.llen("tm:r:backlog:short") == 275

    # and workers finish the run exactly once
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    totals = wait_run_finished(rclient, "r", 60)["totals"]
    assert totals["done"] == 300 and totals["queued"] == totals["running"] == 0


def test_status_shows_progress_failures_and_admission(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    sim, url = start_sim(tmp_path, "--context-length", "600", "--sim-mean-output-tokens", "20")
    procs.append(sim)
    env = worker_env(redis_url, url)
    rows = [{"prompt": f"q{i}"} for i in range(20)] + [{"id": "big", "prompt": "w " * 2000}]
    cli(
        "enqueue",
        str(write_jsonl(tmp_path / "B1.jsonl", rows)),
        "--run",
        "r",
        "--short-max-tokens",
        "50",
        "--long-max-tokens",
        "50",
        env=env,
    )
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    procs.append(start_worker(tmp_path, "long", env, concurrency=1))
    wait_run_finished(rclient, "r", 60)

    doc = orjson.loads(cli("status", "--run", "r", "--json", env=env).stdout)
    assert doc["totals"] == {"queued": 0, "running": 0, "done": 20, "failed": 1, "total": 21}
    assert doc["failures"] == {"context_length": 1}
    assert "context length" in doc["failure_messages"]["context_length"]
    assert doc["eta_s"] == 0.0 and doc["tokens_per_s"] > 0
    assert doc["admission"][url]["budget"] > 0 and doc["admission"][url]["admitted"] == 21

    human = cli("status", "--run", "r", env={**env, "COLUMNS": "160"}).stdout
    assert "run r: 20/21 done" in human and "B1" in human and "context_length" in human
    assert "admission" in human and url in human

    # --watch keeps refreshing until interrupted, and exits cleanly on Ctrl-C
    log = tmp_path / "watch.out"
    with log.open("w") as fh:
        watch = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "status", "--run", "r", "--watch", "--interval", "0.2"],
            cwd=ROOT,
            env={**os.environ, **env, "COLUMNS": "160"},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        wait_for(
            lambda: log.read_text().count("run r: 20/21 done") >= 2, 30, "two refreshes of status --watch"
        )
        watch.send_signal(signal.SIGINT)
        assert watch.wait(20) == 130


def test_tokens_per_s_counts_the_second_the_status_is_read_in(rclient: redis.Redis) -> None:
    # Given a run whose every token was committed in the current second (a small run, fast)
    now = int(rclient.time()[0])
    rclient.hset(keys.RunKeys("r").throughput(), str(now), 600)

    # Then status, read in that second, shows them: 600 tokens over its 60-second window
    assert run_status(rclient, "r")["tokens_per_s"] == 10.0
