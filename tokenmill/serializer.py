"""The ``orjson`` serializer, registered with kombu: JSON on the wire, orjson's speed.

Registered under the ``application/json`` content type, so every JSON message (ours, Celery's
events, and the bulk messages the producer writes directly) decodes through orjson, and the
accept list can stay JSON-only. Pickle is never registered or accepted.
"""

from __future__ import annotations

from typing import Any

import orjson
from kombu.serialization import register

NAME = "orjson"
CONTENT_TYPE = "application/json"


def dumps(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()


def register_orjson() -> None:
    """Idempotent: (re)register the orjson codec with kombu."""
    register(NAME, dumps, orjson.loads, content_type=CONTENT_TYPE, content_encoding="utf-8")
