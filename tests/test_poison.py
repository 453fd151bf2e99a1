"""Poison messages: a message on a queue that no worker can run is set aside, and the rest runs."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import generate_latest
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer.metrics import registry_for
from producer.status import run_status
from tests.pipeline import cli, write_jsonl
from tests.procs import Proc, start_sim, start_worker, wait_for, worker_env
from tokenmill import dead_letters, keys
from tokenmill.local_redis import free_port
from tokenmill.messages import task_message


def envelope(args: Any = ("r", "P", "P:x"), *, body: bytes | None = None, **fields: Any) -> dict[str, Any]:
    """A task message as the producer builds it, with ``args`` (or a raw ``body``) and top-level
    ``fields`` (``headers`` and ``properties`` are merged into the message's own)."""
    msg: dict[str, Any] = orjson.loads(task_message("r", "P", "P:x", "short"))
    payload = body if body is not None else orjson.dumps([list(args), {}, {"callbacks": None}])
    msg["body"] = base64.b64encode(payload).decode()
    for name, value in fields.items():
        msg[name] = {**msg[name], **value} if name in ("headers", "properties") else value
    return msg


# (what is wrong, the message, the words its dead letter's reason must hold)
POISON: list[tuple[str, Any, str]] = [
    (
        "a body that is not [args, kwargs, embed]",
        envelope(body=orjson.dumps({"a": "x" * 100_000})),
        "not [args",
    ),
    ("two arguments", envelope(("r", "P")), "takes 3 arguments"),
    ("a job id that is a number", envelope(("r", "P", 7)), "argument job_id is int"),
    ("a body that is not JSON", envelope(body=b"\x00{not json"), "the body is not JSON"),
    (
        "pickle",
        envelope(body=b"\x80\x04N.", **{"content-type": "application/x-python-serialize"}),
        "content type 'application/x-python-serialize'",
    ),
    ("an unknown task", envelope(headers={"task": "evil.task"}), "unknown task 'evil.task'"),
    ("no task header", {k: v for k, v in envelope().items() if k != "headers"}, "no task header"),
    ("a broker message that is not JSON", "not json at all", "not JSON, so not a kombu message"),
    ("JSON that is not a kombu message", [1, 2, 3], "not a kombu message"),
]


def raw(message: Any) -> bytes:
    return message.encode() if isinstance(message, str) else orjson.dumps(message)


def test_poison_messages_are_set_aside_and_the_worker_runs_the_job_after_them(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given poison messages of every kind on the short queue, then a valid job's message behind them
    sim, url = start_sim(tmp_path)
    procs.append(sim)
    env = worker_env(redis_url, url)
    for _, message, _ in POISON:
        rclient.lpush(keys.broker_queue("short"), raw(message))
    cli("enqueue", str(write_jsonl(tmp_path / "P.jsonl", [{"prompt": "hello"}])), "--run", "r", env=env)

    # When one worker consumes the queue
    worker = start_worker(tmp_path, "short", env, concurrency=2)
    procs.append(worker)

    # Then the worker stays up, the valid job is done and every poison message is a dead letter
    def settled() -> bool:
        assert worker.alive(), f"the worker stopped:\n{worker.output()[-3000:]}"
        done = run_status(rclient, "r")["totals"]["done"] == 1
        return done and rclient.llen(keys.dead_letters()) == len(POISON)

    wait_for(settled, 60, "the valid job done and every poison message set aside")
    letters = [orjson.loads(x) for x in reversed(rclient.lrange(keys.dead_letters(), 0, -1))]
    for (what, message, reason), letter in zip(POISON, letters, strict=True):
        assert reason in letter["reason"], (what, letter)
        assert letter["queue"] == "short", (what, letter)
        sent_id = message["headers"]["id"] if isinstance(message, dict) and "headers" in message else None
        assert letter["id"] == sent_id, (what, letter)
    assert len(letters[0]["body"]) < dead_letters.BODY_CHARS + 40  # the 100 KB body, truncated
    # and each was logged once, never whole; none is left on the queue or, once the valid job's
    # ack follows its commit, waiting for an ack
    log = worker.output()
    assert log.count("poison message ") == len(POISON) and "x" * 1000 not in log
    assert rclient.llen(keys.broker_queue("short")) == 0
    wait_for(lambda: rclient.hlen(keys.broker_unacked()) == 0, 10, "no message waiting for an ack")

    # and status, its plain view and the metrics count them
    assert orjson.loads(cli("status", "--run", "r", "--json", env=env).stdout)["dead_letters"] == len(POISON)
    assert f"dead letters: {len(POISON)} message(s)" in cli("status", "--run", "r", env=env).stdout
    scraped = generate_latest(registry_for(rclient)).decode()
    assert f"tokenmill_dead_letters_total {float(len(POISON))}" in scraped


def test_a_message_the_producer_builds_is_not_poison() -> None:
    assert dead_letters.problem(envelope()) is None
    assert dead_letters.problem(orjson.loads(task_message("run-1", "P", 'P:a "b"', "long"))) is None


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (envelope(properties={"body_encoding": "rot13"}), "the body's encoding 'rot13' is not base64"),
        ({**envelope(), "body": "abc"}, "the body is not base64"),
        (envelope(("r", "P", "x"), **{"content-encoding": "latin-1"}), "('latin-1') is not accepted"),
        (envelope(("r", "P", "x"), headers={"id": None}), "no id header"),
        (envelope(body=orjson.dumps([["r", "P", "x"], {}, None])), "embed (its third item) is not an object"),
        (envelope(body=orjson.dumps([["r", "P"], {"job_id": "x"}, {}])), "keywords ['job_id']"),
        (envelope(("a b", "P", "x")), "--run 'a b' is not a valid run name"),
        ({"properties": {}, "headers": {"task": "tokenmill.generate"}}, "no delivery_tag"),
    ],
)
def test_each_kind_of_poison_message_is_named(message: Any, reason: str) -> None:
    assert reason in (dead_letters.problem(message) or ""), dead_letters.problem(message)


def test_a_dead_letter_redis_cannot_take_is_still_logged_and_stops_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a Redis nobody answers for
    client = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    # When a poison message is buried there, Then nothing is raised and its log line names it
    dead_letters.bury(client, "short", "no task header", b"{}", envelope(headers={"id": "t-1"}))
    assert "poison message t-1 on queue short set aside" in caplog.text
    assert "t-1 not recorded in the dead letters" in caplog.text
