"""Poison messages: what is wrong with a broker message no worker can run, and the dead letters.

A message on the ``short`` or ``long`` queue that is not a ``tokenmill.generate(run, partition,
job_id)`` task message (not a kombu envelope, no task or another task, a content type other than
JSON, a body that is not JSON or not ``[args, kwargs, embed]``, arguments of the wrong number or
type) was dropped with a log line, failed as a task error, or made kombu or Celery raise in the
worker's consumer, which stopped the worker, and the redelivered message the next one (a body
that is not ``[args, kwargs, embed]``). :func:`problem` names what is wrong before the message is
delivered (``tokenmill/kombu_patch.py`` asks it), and :func:`bury` keeps a small record of the
message in a capped list and counts it; status, the dashboard and the metrics show the count.
It is one count for the whole Redis: the queues are shared by every run, and a poison message
may name no run (or a run that does not exist).
"""

from __future__ import annotations

import binascii
import logging
import time
from typing import Any

import orjson
import redis

from tokenmill import keys
from tokenmill.errors import ConfigError
from tokenmill.messages import TASK_NAME
from tokenmill.serializer import CONTENT_TYPE

log = logging.getLogger("tokenmill.dead_letters")
KEPT = 1000  # records kept, newest first; the count covers every poison message ever seen
BODY_CHARS = 500  # of a message's body, kept in its record and its log line
ARGUMENTS = ("run", "partition", "job_id")


def problem(envelope: Any) -> str | None:
    """Why a worker cannot run ``envelope`` (a broker message as parsed from JSON), or None."""
    if not isinstance(envelope, dict) or not isinstance(envelope.get("properties"), dict):
        return "not a kombu message (a JSON object with headers, properties and body)"
    if "delivery_tag" not in envelope["properties"]:
        return "no delivery_tag in the message's properties"
    headers = envelope.get("headers")
    if not isinstance(headers, dict) or (task := headers.get("task")) is None:
        return "no task header"
    if task != TASK_NAME:
        return f"unknown task {task!r:.80}: tokenmill's queues carry only {TASK_NAME}"
    if not isinstance(headers.get("id"), str):
        return "no id header"
    ctype, encoding = envelope.get("content-type"), envelope.get("content-encoding")
    if ctype != CONTENT_TYPE or str(encoding).lower() != "utf-8":
        return f"content type {ctype!r:.80} ({encoding!r:.40}) is not accepted: only {CONTENT_TYPE} in utf-8"
    try:
        payload = orjson.loads(body(envelope))
    except orjson.JSONDecodeError as exc:
        return f"the body is not JSON: {exc}"
    except ValueError as exc:
        return str(exc)
    return _arguments_problem(payload)


def body(envelope: dict[str, Any]) -> bytes:
    """The message's body as its sender encoded it; ValueError if it cannot be decoded."""
    raw, properties = envelope.get("body"), envelope.get("properties")
    encoding = properties.get("body_encoding") if isinstance(properties, dict) else None
    if not isinstance(raw, str):
        raise ValueError(f"the body is {type(raw).__name__}, not a string")
    if encoding is None:
        return raw.encode()
    if encoding != "base64":
        raise ValueError(f"the body's encoding {encoding!r:.40} is not base64")
    try:
        return binascii.a2b_base64(raw)  # as leniently as kombu decodes it
    except ValueError as exc:  # binascii.Error, or a character that is not ASCII
        raise ValueError(f"the body is not base64: {exc}") from None


def _arguments_problem(payload: Any) -> str | None:
    """What is wrong with a decoded body as the arguments of ``tokenmill.generate``, or None."""
    shaped = isinstance(payload, list) and len(payload) == 3
    if not shaped or not (isinstance(payload[0], list) and isinstance(payload[1], dict)):
        return "the body is not [args, kwargs, embed] (Celery's task protocol 2)"
    if not isinstance(payload[2], dict):
        return "the body's embed (its third item) is not an object"
    args, kwargs, _ = payload
    if kwargs or len(args) != len(ARGUMENTS):
        return f"{TASK_NAME} takes 3 arguments {ARGUMENTS}, got {len(args)} and keywords {sorted(kwargs)}"
    for name, value in zip(ARGUMENTS, args, strict=True):
        if not isinstance(value, str):
            return f"argument {name} is {type(value).__name__} {value!r:.40}, not a string"
    try:
        keys.check_run(args[0])
    except ConfigError as exc:
        return str(exc)
    return None


def bury(client: redis.Redis, queue: str, reason: str, raw: str | bytes, envelope: Any = None) -> None:
    """Log the poison message once and keep its record in the dead letters (never raises): when,
    its queue, why, its task id, and the start of its body (decoded when it can be, else the raw
    message)."""
    headers = envelope.get("headers") if isinstance(envelope, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    task_id = task_id[:100] if isinstance(task_id, str) else None
    try:
        text: str | bytes = body(envelope) if isinstance(envelope, dict) else raw
    except ValueError:
        text = raw
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if len(text) > BODY_CHARS:
        text = f"{text[:BODY_CHARS]}… ({len(text)} characters)"
    reason = reason[:BODY_CHARS]  # a reason quotes what it found (a run name, a task name)
    letter = {"at": round(time.time(), 3), "queue": queue, "reason": reason, "id": task_id, "body": text}
    log.error(
        "poison message %s on queue %s set aside in %s, not run: %s; body: %s",
        task_id or "(no id)",
        queue,
        keys.dead_letters(),
        reason,
        text,
    )
    try:
        pipe = client.pipeline()  # MULTI: the record and the count move together
        pipe.lpush(keys.dead_letters(), orjson.dumps(letter))
        pipe.ltrim(keys.dead_letters(), 0, KEPT - 1)
        pipe.incr(keys.dead_letters_count())
        pipe.execute()
    except redis.RedisError as exc:  # the log line above is then its only record
        log.error("poison message %s not recorded in the dead letters: %s", task_id, exc)
