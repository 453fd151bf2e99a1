"""Pausing the workers' consumers while no server is ready, and resuming them on their queues."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from server_mgr import consumers
from server_mgr.consumers import (
    ConsumerGate,
    celery_control,
    pause_consumers,
    paused_reason,
    resume_consumers,
)
from tests.procs import Proc, start_worker, wait_for, worker_env
from tokenmill import servers
from tokenmill.servers import ServerRecord
from tokenmill.settings import Settings
from tokenmill.worker_registry import registered_consumers


class FakeControl:
    """Records the Celery control calls; two workers consume short, one long."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []

    def inspect(self, timeout: float) -> Any:
        control = self

        class Inspect:
            def active_queues(self) -> dict[str, list[dict[str, str]]]:
                control.calls.append(("inspect", "", timeout))
                return {"w1@h": [{"name": "short"}], "w2@h": [{"name": "short"}], "w3@h": [{"name": "long"}]}

        return Inspect()

    def cancel_consumer(self, queue: str, destination: Any = None) -> None:
        self.calls.append(("cancel", queue, destination))

    def add_consumer(self, queue: str, destination: Any = None) -> None:
        self.calls.append(("add", queue, destination))


def test_pause_cancels_every_consumer_and_resume_restores_each_queue_on_its_workers(
    rclient: redis.Redis,
) -> None:
    control = FakeControl()
    pause_consumers(rclient, control, "no server is ready: gpu0 down")
    assert paused_reason(rclient) == "no server is ready: gpu0 down"
    assert ("cancel", "short", None) in control.calls and ("cancel", "long", None) in control.calls
    control.calls.clear()
    resume_consumers(rclient, control)
    assert paused_reason(rclient) is None
    assert sorted(control.calls) == [("add", "long", ["w3@h"]), ("add", "short", ["w1@h", "w2@h"])]


def test_the_gate_pauses_while_no_fresh_server_is_ready(rclient: redis.Redis) -> None:
    control = FakeControl()
    gate = ConsumerGate(rclient, control, stale_after_s=30, rebroadcast_s=3600)
    servers.publish(
        rclient,
        ServerRecord(name="a", url="u", state=servers.DOWN, updated_at=time.time(), last_error="killed"),
    )
    gate.sync()
    assert paused_reason(rclient) == "no server is ready: a down (killed)"
    stale = time.time() - 60
    servers.publish(rclient, ServerRecord(name="b", url="u", state=servers.READY, updated_at=stale))
    gate.sync()
    assert paused_reason(rclient) is not None  # a stale "ready" has no live manager behind it
    servers.update(rclient, "b", updated_at=time.time())
    gate.sync()
    assert paused_reason(rclient) is None
    assert [c[0] for c in control.calls].count("cancel") == 2  # no rebroadcast within an hour


def _names(control: Any) -> tuple[str, str] | None:
    """The full names of the short and the long worker, once both answer."""
    replies = control.inspect(timeout=1.0).active_queues() or {}
    found = [next((w for w in replies if w.startswith(prefix)), None) for prefix in ("wshort@", "wlong@")]
    return (found[0], found[1]) if found[0] and found[1] else None


def _queues(control: Any, worker: str) -> list[str] | None:
    replies = control.inspect(timeout=1.0, destination=[worker]).active_queues() or {}
    return sorted(q["name"] for q in replies[worker]) if worker in replies else None


def _wait_consuming(
    control: Any, short: str, long: str, queues: tuple[list[str], list[str]], what: str
) -> None:
    """Wait until the short and the long worker consume ``queues`` (each a sorted list)."""
    wait_for(lambda: (_queues(control, short), _queues(control, long)) == queues, 10, what)


def _real_workers(tmp_path: Path, redis_url: str, procs: list[Proc]) -> tuple[Any, str, str]:
    """A real worker on ``short`` and one on ``long``, both answering; returns the Celery control
    and their full names."""
    env = worker_env(redis_url, "http://127.0.0.1:9")
    procs.append(start_worker(tmp_path, "short", env, concurrency=2, name="wshort"))
    procs.append(start_worker(tmp_path, "long", env, concurrency=2, name="wlong"))
    control = celery_control(Settings.load(redis_url=redis_url))
    short, long = wait_for(lambda: _names(control), 20, "both workers to answer")
    return control, short, long


def test_real_workers_stop_consuming_and_resume_only_their_own_queue(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    control, short, long = _real_workers(tmp_path, redis_url, procs)

    pause_consumers(rclient, control, "no server is ready: test")
    _wait_consuming(control, short, long, ([], []), "both workers to stop consuming")
    resume_consumers(rclient, control)
    _wait_consuming(control, short, long, (["short"], ["long"]), "each worker to consume its own queue again")


def test_workers_paused_unseen_are_resumed_on_their_own_queues_from_their_registration(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a real worker on each queue, registered when ready
    control, short, long = _real_workers(tmp_path, redis_url, procs)
    assert sorted(registered_consumers(rclient).items()) == [("long", [long]), ("short", [short])]

    # When a pause asks which workers consume and none answers in time (a worker that just
    # started: seen in compose, where no worker consumed again after the server came up)
    monkeypatch.setattr(consumers, "_active_consumers", lambda control: {})
    pause_consumers(rclient, control, "no server is ready: starting")
    _wait_consuming(control, short, long, ([], []), "both workers to stop consuming")
    resume_consumers(rclient, control)

    # Then each consumes its own queue again, and only it
    _wait_consuming(control, short, long, (["short"], ["long"]), "each worker to consume its own queue again")


def test_a_worker_unregisters_when_it_stops(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    _control, short, _long = _real_workers(tmp_path, redis_url, procs)
    worker = next(p for p in procs if "wshort" in " ".join(map(str, p.proc.args)))
    worker.signal(signal.SIGTERM)
    wait_for(lambda: short not in registered_consumers(rclient).get("short", []), 30, "the short worker gone")
    assert list(registered_consumers(rclient)) == ["long"]


def test_the_gate_stops_real_workers_while_no_server_is_ready_and_restarts_each_on_its_queue(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a real worker on each queue and a gate driving them through Celery's own control
    control, short, long = _real_workers(tmp_path, redis_url, procs)
    gate = ConsumerGate(rclient, control, stale_after_s=30, rebroadcast_s=3600)

    # When the only server is down
    down = ServerRecord(name="a", url="u", state=servers.DOWN, updated_at=time.time(), last_error="killed")
    servers.publish(rclient, down)
    gate.sync()
    # Then neither worker consumes any queue
    _wait_consuming(control, short, long, ([], []), "the gate to stop both workers consuming")
    assert paused_reason(rclient) == "no server is ready: a down (killed)"

    # When the server is ready again
    servers.update(rclient, "a", state=servers.READY, last_error="", updated_at=time.time())
    gate.sync()
    # Then each worker consumes its own queue again, and only it
    _wait_consuming(
        control, short, long, (["short"], ["long"]), "the gate to restart each worker on its own queue"
    )
    assert paused_reason(rclient) is None
