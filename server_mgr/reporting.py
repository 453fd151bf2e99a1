"""Where a supervisor reports: Redis for ``server up``, only the log for ``check-quality``.

Also ``tokenmill server stop`` from any host: it leaves stop requests in Redis and waits for
``down``. The supervisor that runs a server (wherever it is) takes its request within half a
second, drains, stops the process group and publishes ``down``. A server whose record is not
refreshed has no live supervisor: there is nothing to ask, and the request is withdrawn.
A Redis outage never stops a supervisor: the server keeps running and the write is retried with
the next report.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import click
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


def clear_stop_request(client: redis.Redis, name: str) -> None:
    """Forget a stale stop request (a new ``server up`` must not obey an old one)."""
    client.delete(keys.server_stop(name))


def stop_servers(
    client: redis.Redis, names: list[str], drain: bool, timeout_s: float | None, stale_after_s: float
) -> bool:
    """Ask every server in ``names`` to stop; with a timeout, wait for each to be down.

    Returns False when a server is unknown or did not stop in time.
    """
    pending: list[str] = []
    ok = True
    for name in names:
        record = servers.load(client, name)
        if record is None:
            click.echo(f"{name}: no such server in Redis")
            ok = False
        elif record.state in (servers.DOWN, servers.FAILED) and not record.is_fresh(stale_after_s):
            click.echo(f"{name}: already {record.state}")
        elif not record.is_fresh(stale_after_s):
            click.echo(
                f"{name}: {record.state}, but no supervisor has refreshed it for "
                f"{time.time() - record.updated_at:.0f} s; nothing to stop"
            )
            ok = False
        else:
            request = {"drain": drain, "at": time.time(), "by": f"{socket.gethostname()}:{os.getpid()}"}
            client.set(keys.server_stop(name), orjson.dumps(request))
            pending.append(name)
            click.echo(f"{name}: stop requested ({'drain first' if drain else 'now'})")
    if timeout_s is None:
        return ok
    return _wait_down(client, pending, timeout_s) and ok


def _wait_down(client: redis.Redis, names: list[str], timeout_s: float) -> bool:
    """Wait until each supervisor took its request and published down (or failed)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(names)
    while waiting:
        for name in list(waiting):
            record = servers.load(client, name)
            taken = not client.exists(keys.server_stop(name))
            failed = record is not None and record.state == servers.FAILED
            if record is None or not (failed or (taken and record.state == servers.DOWN)):
                continue
            if failed:
                clear_stop_request(client, name)
            click.echo(f"{name}: {record.state}")
            waiting.remove(name)
        if waiting and time.monotonic() >= deadline:
            for name in waiting:
                click.echo(f"{name}: not down after {timeout_s:g} s")
            return False
        if waiting:
            time.sleep(0.2)
    return True
