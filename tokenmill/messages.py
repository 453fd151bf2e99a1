"""Celery-compatible task messages, built directly for bulk publishing.

``apply_async`` costs a Python round trip per message (~870 messages/s here); the producer and the
reaper instead LPUSH messages built here, in pipelines or inside ledger scripts. The envelope is
exactly what kombu's Redis transport writes for Celery task protocol 2 (checked by a test against
a message published with ``send_task``), so any ``celery worker`` consumes it unchanged.
"""

from __future__ import annotations

import base64
import os
import socket
import uuid

import orjson

from tokenmill.app import TASK_NAME

_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_ORIGIN = f"tokenmill-producer@{socket.gethostname()}:{os.getpid()}"


def task_message(run: str, partition: str, job_id: str, queue: str) -> bytes:
    """The raw broker message that runs ``tokenmill.generate(run, partition, job_id)`` on ``queue``."""
    task_id = str(uuid.uuid4())
    args = [run, partition, job_id]
    body = orjson.dumps([args, {}, _EMBED])
    envelope = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": TASK_NAME,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": repr(args),
            "kwargsrepr": "{}",
            "origin": _ORIGIN,
            "ignore_result": True,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        "properties": {
            "correlation_id": task_id,
            "reply_to": None,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return orjson.dumps(envelope)
