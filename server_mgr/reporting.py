"""Where a supervisor reports: Redis for ``server up``, only the log for ``check-quality``.

Also the stop requests ``tokenmill server stop`` leaves in Redis for a supervisor on any host.
A Redis outage never stops a supervisor: the server keeps running and the write is retried with
the next report.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import orjson
import redis

from tokenmill import history, keys, servers
from tokenmill.series import SeriesWriter
from tokenmill.servers import ServerRecord

log = logging.getLogger("tokenmill.server")


class LogReporter:
    """What a supervisor reports to; this one reports to the manager's log only (a quality check
    must not attract workers)."""

    def publish(self, record: ServerRecord, **extra: Any) -> None:
        """The whole record (plus fields outside :class:`ServerRecord`)."""
        log.debug("%s: %s", record.name, record.state)

    def event(self, name: str, kind: str, message: str, **data: Any) -> None:
        """One action of the manager (launch, restart, OOM step, verdict)."""
        log.info("[%s] %s: %s", name, kind, message)

    def take_stop_request(self, name: str) -> dict[str, Any] | None:
        """A pending stop request for ``name`` (consumed), or None."""
        return None

    def previous_pid(self, name: str) -> int | None:
        """The pid an earlier run published for ``name`` (to find an orphaned server)."""
        return None


class RedisReporter(LogReporter):
    """Publishes records and events in Redis (:mod:`tokenmill.servers`) and reads stop requests;
    each publish that changes a server's state or restarts adds a point to its state series
    (:mod:`tokenmill.history`), kept ``series_keep_s``."""

    def __init__(self, client: redis.Redis, series_keep_s: float = 7 * 86400.0) -> None:
        self.client = client
        self.states = SeriesWriter(client, step_s=1.0, keep_s=series_keep_s)  # a point per change

    def publish(self, record: ServerRecord, **extra: Any) -> None:
        try:
            servers.publish(self.client, record)
            if extra:
                servers.update(self.client, record.name, updated_at=record.updated_at, **extra)
            history.record_state(self.states, record)
        except redis.RedisError as exc:
            log.warning("[%s] cannot publish the server state in Redis: %s", record.name, exc)

    def event(self, name: str, kind: str, message: str, **data: Any) -> None:
        super().event(name, kind, message, **data)
        try:
            servers.record_event(self.client, name, kind, message, **data)
        except redis.RedisError as exc:
            log.warning("[%s] cannot record the event in Redis: %s", name, exc)

    def take_stop_request(self, name: str) -> dict[str, Any] | None:
        try:
            raw = self.client.getdel(keys.server_stop(name))
        except redis.RedisError:
            return None
        return orjson.loads(raw) if raw else None

    def previous_pid(self, name: str) -> int | None:
        try:
            record = servers.load(self.client, name)
        except redis.RedisError:
            return None
        return record.pid if record else None


def request_stop(client: redis.Redis, name: str, *, drain: bool = True) -> None:
    """Ask the supervisor of ``name`` (on whichever host) to drain and stop its server."""
    request = {"drain": drain, "at": time.time(), "by": f"{socket.gethostname()}:{os.getpid()}"}
    client.set(keys.server_stop(name), orjson.dumps(request))


def clear_stop_request(client: redis.Redis, name: str) -> None:
    """Forget a stale stop request (a new ``server up`` must not obey an old one)."""
    client.delete(keys.server_stop(name))
