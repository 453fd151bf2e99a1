"""``tokenmill server stop`` from any host: leave stop requests in Redis, wait for ``down``.

The supervisor that runs a server (wherever it is) takes its request within half a second,
drains, stops the process group and publishes ``down``. A server whose record is not refreshed
has no live supervisor: there is nothing to ask, and the request is withdrawn.
"""

from __future__ import annotations

import time

import click
import redis

from server_mgr.reporting import clear_stop_request, request_stop
from tokenmill import keys, servers

STALE_AFTER_S = 30.0
_FINAL = (servers.DOWN, servers.FAILED)


def stop_servers(client: redis.Redis, names: list[str], *, drain: bool, timeout_s: float | None) -> bool:
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
        elif record.state in _FINAL and not record.is_fresh(STALE_AFTER_S):
            click.echo(f"{name}: already {record.state}")
        elif not record.is_fresh(STALE_AFTER_S):
            click.echo(
                f"{name}: {record.state}, but no supervisor has refreshed it for "
                f"{time.time() - record.updated_at:.0f} s; nothing to stop"
            )
            ok = False
        else:
            request_stop(client, name, drain=drain)
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
