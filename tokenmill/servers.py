"""The published state of inference servers: what server managers write and workers read.

One Redis hash per server (:func:`tokenmill.keys.server`) plus a set of every server name
(:func:`tokenmill.keys.servers`). A server manager publishes the state, the URL, the capacity
read from ``/server_info`` and live figures (stored as ``live.<name>`` fields); workers read the
records to decide where to send work and how many tokens a server can take.

States: ``starting`` (launched, not yet answering ``/health``), ``ready`` (send work),
``draining`` (finishing in-flight work, take no new work), ``down`` (stopped or restarting),
``failed`` (gave up: the reason is in ``last_error``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from tokenmill import keys
from tokenmill.replies import text
from tokenmill.url_secrets import redact_url

if TYPE_CHECKING:
    import redis
    from redis.typing import EncodableT, FieldT

    from tokenmill.quick_redis import ReadClient

STARTING = "starting"
READY = "ready"
DRAINING = "draining"
DOWN = "down"
FAILED = "failed"
STATES = (STARTING, READY, DRAINING, DOWN, FAILED)

LIVE_PREFIX = "live."
_TEXTS = {"url": "", "state": DOWN, "engine": "sglang", "last_error": ""}  # text fields, when absent
EVENTS_KEPT = 200


@dataclass(slots=True)
class ServerRecord:
    """One server as published. ``live`` holds figures such as ``running_req``, ``token_usage``."""

    name: str
    url: str
    state: str
    engine: str = "sglang"
    pid: int | None = None
    restarts: int = 0
    max_total_num_tokens: int | None = None
    context_length: int | None = None
    last_error: str = ""
    updated_at: float = 0.0
    live: dict[str, float] = field(default_factory=dict)

    def is_fresh(self, max_age_s: float, now: float | None = None) -> bool:
        """Whether the record was refreshed within ``max_age_s`` (its manager is alive)."""
        return ((time.time() if now is None else now) - self.updated_at) <= max_age_s


def name_of(url: str) -> str:
    """The name of a server nobody manages, in key names and results: its URL as shown (a
    URL without secrets is its own name, as it always was)."""
    return redact_url(url)


def _encode(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _mapping(values: dict[str, Any]) -> dict[FieldT, EncodableT]:
    """Hash fields for ``values``: ``live`` flattened to ``live.<name>``, None stored as ``""``."""
    out: dict[FieldT, EncodableT] = {}
    for name, value in values.items():
        if name == "live":
            out.update({LIVE_PREFIX + k: _encode(v) for k, v in (value or {}).items()})
        else:
            out[name] = _encode(value)
    return out


def publish(redis_client: redis.Redis, record: ServerRecord) -> None:
    """Write the whole record (one HSET) and register its name (SADD), in one pipeline."""
    update(redis_client, record.name, **asdict(record))


def update(redis_client: redis.Redis, name: str, /, **values: Any) -> None:
    """Set some fields of a server's record; ``updated_at`` is refreshed unless given.

    ``live=`` merges figures into the ``live.*`` fields. Fields that are not part of
    :class:`ServerRecord` (e.g. ``mem_fraction_static``) are stored too and ignored by :func:`load`.
    """
    values.setdefault("updated_at", time.time())
    pipe = redis_client.pipeline(transaction=True)
    pipe.hset(keys.server(name), mapping=_mapping(values))
    pipe.sadd(keys.servers(), name)
    pipe.execute()


def load(redis_client: redis.Redis, name: str) -> ServerRecord | None:
    """The record of ``name``, or None if it was never published."""
    raw = redis_client.hgetall(keys.server(name))
    return _decode(name, raw) if raw else None


def load_all(redis_client: ReadClient) -> list[ServerRecord]:
    """Every published record, sorted by name."""
    names = sorted(text(n) for n in redis_client.smembers(keys.servers()))
    pipe = redis_client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(keys.server(name))
    return [_decode(n, raw) for n, raw in zip(names, pipe.execute(), strict=True) if raw]


def record_event(redis_client: redis.Redis, name: str, kind: str, message: str, **data: Any) -> None:
    """Prepend one action of the manager (restart, OOM step, verdict) to the server's event list."""
    event = {"ts": time.time(), "kind": kind, "message": message, **data}
    pipe = redis_client.pipeline(transaction=True)
    pipe.lpush(keys.server_events(name), orjson.dumps(event))
    pipe.ltrim(keys.server_events(name), 0, EVENTS_KEPT - 1)
    pipe.execute()


def _number(value: str, kind: type[int] | type[float]) -> int | float | None:
    try:
        return kind(float(value))
    except ValueError:
        return None


def _decode(name: str, raw: dict[Any, Any]) -> ServerRecord:
    data = {text(k): text(v) for k, v in raw.items()}
    live = {
        k[len(LIVE_PREFIX) :]: float(v)
        for k, v in data.items()
        if k.startswith(LIVE_PREFIX) and _number(v, float) is not None
    }
    values: dict[str, Any] = {"name": name, **{key: data.get(key, absent) for key, absent in _TEXTS.items()}}
    for key in ("pid", "max_total_num_tokens", "context_length"):  # "" (unknown) -> None
        values[key] = _number(data.get(key, ""), int)
    for key, kind in (("restarts", int), ("updated_at", float)):
        number = _number(data.get(key, ""), kind)
        if number is not None:
            values[key] = number
    return ServerRecord(**values, live=live)
