"""A guard around kombu's Redis ``QoS.restore_unacked`` (kombu 5.7).

When Redis goes away while a threads-pool worker is acking, kombu closes the channel and tries to
restore its unacked messages through a connection it has already released; that raises
``AttributeError: 'NoneType' object has no attribute 'hostname'``, which Celery treats as an
unrecoverable error and stops the worker (found by tests/test_chaos.py). The restore could not
reach Redis anyway: the messages stay in kombu's unacked hash, and tokenmill's leases, waiting
leases and reconciler put their jobs back on the queue. So the error is logged, not fatal.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.transport import redis as kombu_redis

log = logging.getLogger("tokenmill.kombu")
_original = kombu_redis.QoS.restore_unacked


def _restore_unacked(self: Any, client: Any = None) -> Any:
    try:
        return _original(self, client)
    except AttributeError as exc:
        log.warning(
            "could not restore unacked messages while the broker connection was lost (%s); "
            "tokenmill's leases and reconciler requeue their jobs",
            exc,
        )
        return None


def apply() -> None:
    """Install the guard (idempotent)."""
    kombu_redis.QoS.restore_unacked = _restore_unacked  # type: ignore[method-assign]
