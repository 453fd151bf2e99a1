"""Pausing and resuming the workers' consumers while no server is ready.

Workers must neither fail jobs nor burn retries while the server restarts, so the manager tells
them to stop consuming (Celery's ``cancel_consumer`` broadcast) and records the reason in the
:func:`tokenmill.keys.worker_control` hash (field ``paused``) for workers that start meanwhile.
Resuming sends ``add_consumer`` only to the workers that consumed each queue before the pause (a
broadcast would make a ``short`` worker take ``long`` jobs too); that list is kept in the same
hash (field ``consumers``), so any manager on any host can resume.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import orjson

from tokenmill import keys, servers
from tokenmill.settings import Settings
from tokenmill.worker_registry import registered_consumers

if TYPE_CHECKING:
    import redis

    from tokenmill.quick_redis import ReadClient

log = logging.getLogger("tokenmill.server.consumers")

PAUSED = "paused"
CONSUMERS = "consumers"


def celery_control(settings: Settings) -> Any:
    """The Celery app's control API, configured for ``settings``' broker."""
    from tokenmill.app import configure

    return configure(settings).control


def paused_reason(client: ReadClient) -> str | None:
    """Why consumers are paused, or None when they are not."""
    value = client.hget(keys.worker_control(), PAUSED)
    return value.decode() if isinstance(value, bytes) else value


def pause_consumers(client: redis.Redis, control: Any, reason: str) -> None:
    """Record ``reason`` in the worker control hash and cancel every worker's queue consumers."""
    known = _known(client, _active_consumers(control))
    client.hset(
        keys.worker_control(),
        mapping={
            PAUSED: reason,
            "paused_at": str(time.time()),
            "paused_by": f"{socket.gethostname()}:{os.getpid()}",
            CONSUMERS: orjson.dumps(known),
        },
    )
    for queue in keys.QUEUES:
        control.cancel_consumer(queue)
    log.warning("paused the workers' consumers: %s", reason)


def resume_consumers(client: redis.Redis, control: Any) -> None:
    """Clear the pause and re-add each queue's consumer on the workers that had it: those seen
    consuming when the pause began, and every worker that registered its queues (a worker that
    started just before the pause may not answer the inspect in time, and would otherwise never
    consume again)."""
    known = _known(client, registered_consumers(client))
    pipe = client.pipeline(transaction=True)
    pipe.hdel(keys.worker_control(), PAUSED, "paused_at", "paused_by", CONSUMERS)
    pipe.hset(keys.worker_control(), "resumed_at", str(time.time()))
    pipe.execute()
    for queue, workers in known.items():
        if workers:
            control.add_consumer(queue, destination=workers)
    log.warning(
        "resumed the workers' consumers: %s",
        ", ".join(f"{q} on {len(w)} worker(s)" for q, w in known.items()) or "none known",
    )


class ConsumerGate:
    """Keeps consumers paused exactly while no (fresh) server record says ``ready``.

    Every supervisor calls :meth:`sync` on each state change; while paused, the cancel is sent
    again every ``rebroadcast_s`` so a worker that (re)started meanwhile stops too.
    """

    def __init__(
        self,
        client: redis.Redis,
        control: Any,
        *,
        stale_after_s: float = 60.0,
        rebroadcast_s: float = 30.0,
    ) -> None:
        self.client = client
        self.control = control
        self.stale_after_s = stale_after_s
        self.rebroadcast_s = rebroadcast_s
        self._lock = threading.Lock()
        self._last_pause = 0.0

    def sync(self) -> None:
        """Pause or resume according to the published server states (errors are logged)."""
        import redis  # here: `tokenmill server status` reads paused_reason without redis-py

        with self._lock:
            try:
                records = servers.load_all(self.client)
                ready = [r for r in records if r.state == servers.READY and r.is_fresh(self.stale_after_s)]
                paused = paused_reason(self.client)
                if ready:
                    if paused is not None:
                        resume_consumers(self.client, self.control)
                    return
                due = time.monotonic() - self._last_pause >= self.rebroadcast_s
                if paused is None or due:
                    pause_consumers(self.client, self.control, _reason(records))
                    self._last_pause = time.monotonic()
            except (redis.RedisError, OSError) as exc:
                log.warning("cannot pause/resume consumers: %s", exc)


def _reason(records: list[servers.ServerRecord]) -> str:
    if not records:
        return "no server is published"
    states = "; ".join(
        f"{r.name} {r.state}" + (f" ({r.last_error})" if r.last_error else "") for r in records
    )
    return f"no server is ready: {states}"[:500]


def _active_consumers(control: Any) -> dict[str, list[str]]:
    """Queue name -> the workers consuming it now (asks every worker for 1 s; silent ones are missed)."""
    try:
        replies = control.inspect(timeout=1.0).active_queues() or {}
    except Exception as exc:  # any broker trouble just means "nobody answered"
        log.warning("cannot ask the workers which queues they consume: %s", exc)
        return {}
    found: dict[str, list[str]] = {}
    for worker, queues in replies.items():
        for queue in queues or []:
            name = queue.get("name") if isinstance(queue, dict) else None
            if name in keys.QUEUES:
                found.setdefault(name, []).append(worker)
    return found


def _known(client: redis.Redis, more: dict[str, list[str]]) -> dict[str, list[str]]:
    """Queue name -> the workers saved in the control hash or in ``more``, sorted."""
    raw = client.hget(keys.worker_control(), CONSUMERS)
    data = orjson.loads(raw) if raw else {}
    saved = data if isinstance(data, dict) else {}
    return {q: sorted(set(saved.get(q, [])) | set(more.get(q, []))) for q in saved.keys() | more.keys()}
