"""Bulk-built messages are the envelope kombu writes for Celery's ``send_task``."""

from __future__ import annotations

import base64

import orjson
import redis

from tokenmill.app import TASK_NAME, configure
from tokenmill.messages import task_message, task_messages
from tokenmill.settings import Settings


def test_bulk_message_matches_the_envelope_celery_publishes(redis_url: str, rclient: redis.Redis) -> None:
    app = configure(Settings.load(env={}, redis_url=redis_url))
    app.send_task(TASK_NAME, args=["run1", "B1", "job:1"], queue="long")
    theirs = orjson.loads(rclient.lrange("long", 0, -1)[0])
    ours = orjson.loads(task_message("run1", "B1", "job:1", "long"))

    assert ours.keys() == theirs.keys()
    assert ours["headers"].keys() == theirs["headers"].keys()
    assert ours["properties"].keys() == theirs["properties"].keys()
    for field in ("content-encoding", "content-type"):
        assert ours[field] == theirs[field]
    for field in ("lang", "task", "retries", "timelimit", "kwargsrepr", "argsrepr", "eta", "expires"):
        assert ours["headers"][field] == theirs["headers"][field], field
    assert ours["properties"]["delivery_info"] == theirs["properties"]["delivery_info"]
    assert ours["properties"]["body_encoding"] == theirs["properties"]["body_encoding"] == "base64"
    assert base64.b64decode(ours["body"]) == base64.b64decode(theirs["body"])
    assert ours["headers"]["id"] == ours["headers"]["root_id"] == ours["properties"]["correlation_id"]


def test_every_message_has_its_own_task_id() -> None:
    ids = {orjson.loads(task_message("r", "p", "j", "short"))["headers"]["id"] for _ in range(1000)}
    assert len(ids) == 1000


def test_a_batch_renders_each_job_exactly_as_celery_would(redis_url: str, rclient: redis.Redis) -> None:
    app = configure(Settings.load(env={}, redis_url=redis_url))
    jobs = [("P:plain", "short"), ('P:quote " back \\ slash', "long"), ("P:ünï ✍ \u2028", "short")]
    for job_id, queue in jobs:
        app.send_task(TASK_NAME, args=["run1", "P", job_id], queue=queue)
    theirs = [orjson.loads(rclient.rpop(queue)) for _, queue in jobs]

    ours = [orjson.loads(m) for m in task_messages("run1", "P", jobs)]

    for mine, celery, (job_id, queue) in zip(ours, theirs, jobs, strict=True):
        assert base64.b64decode(mine["body"]) == base64.b64decode(celery["body"])
        assert orjson.loads(base64.b64decode(mine["body"]))[0] == ["run1", "P", job_id]
        if job_id.isprintable() and "\\" not in job_id:  # display only (Flower); Celery's saferepr
            # leaves backslashes and unprintable characters as they are, repr() escapes them
            assert mine["headers"]["argsrepr"] == celery["headers"]["argsrepr"]
        assert mine["properties"]["delivery_info"] == celery["properties"]["delivery_info"]
        assert mine["properties"]["delivery_info"]["routing_key"] == queue
    assert len({m["headers"]["id"] for m in ours}) == len(jobs)
