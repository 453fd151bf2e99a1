"""Two guards around places where kombu's Redis transport (5.7) dies on a lost broker, one
around poison messages, and one cost it pays on every message.

When Redis goes away while a threads-pool worker is acking, kombu closes the channel and then:

* ``QoS.restore_unacked`` tries to restore the channel's unacked messages through a connection it
  has already released, raising ``AttributeError: 'NoneType' object has no attribute 'hostname'``;
* an ack that arrives after that, on the now detached channel, asks ``Channel._connparams`` for a
  new connection, and ``self.connection`` (the transport) is gone: another ``AttributeError``.

Celery treats both as unrecoverable and stops the worker (found by tests/test_chaos.py). Neither
operation could reach Redis anyway: the messages stay in kombu's unacked hash, and tokenmill's
leases, waiting leases and reconciler put their jobs back on the queue. So the first is logged,
and the second raises the ``redis.ConnectionError`` that kombu and Celery already recover from.

A message on tokenmill's queues that is not a task message it can run (not JSON, not a kombu
envelope, not ``tokenmill.generate``'s three strings: ``tokenmill.dead_letters.problem``) was
dropped or failed with no record, or made kombu or Celery raise in the consumer, which stopped the
worker (and, redelivered, the next one). Such a message is taken off the queue into the dead
letters instead, before it is delivered (so there is nothing to ack), and the worker goes on.

The cost: every delivery and every ack (``QoS.append``, ``QoS.ack``) asks ``conn_or_acquire`` for
a client, and kombu builds a new ``redis.Redis`` on the channel's pool each time; redis-py's
``Redis.__init__`` sets up its table of response callbacks, ~10% of a short-job worker's
GIL-holding time (py-spy, bench/jobcost.py --profile). A client is only a view of its pool and is
safe to share between threads, so the channel keeps one per pool: a channel whose pool is
replaced (after a reconnect) gets a new one.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson
import redis
from kombu.transport import redis as kombu_redis

from tokenmill import dead_letters, keys

log = logging.getLogger("tokenmill.kombu")
_original_restore = kombu_redis.QoS.restore_unacked
# kombu's Channel has these private methods; celery-types' stub of it (which mypy reads before
# kombu's own annotations) leaves them out
_original_connparams = kombu_redis.Channel._connparams  # type: ignore[attr-defined]
_original_create_client = kombu_redis.Channel._create_client  # type: ignore[attr-defined]
_original_brpop_read = kombu_redis.Channel._brpop_read  # type: ignore[attr-defined]
_original_deliver = kombu_redis.Transport._deliver


def _restore_unacked(self: Any, client: Any = None) -> Any:
    try:
        return _original_restore(self, client)
    except AttributeError as exc:
        log.warning(
            "could not restore unacked messages while the broker connection was lost (%s); "
            "tokenmill's leases and reconciler requeue their jobs",
            exc,
        )
        return None


def _connparams(self: Any, asynchronous: bool = False) -> Any:
    transport = self.connection
    if transport is None or transport.client is None:
        raise redis.ConnectionError("this channel's broker connection was closed")
    return _original_connparams(self, asynchronous)


def _create_client(self: Any, asynchronous: bool = False) -> Any:
    if asynchronous:
        return _original_create_client(self, True)
    pool = self.pool
    client = self.__dict__.get("_tokenmill_client")
    if client is None or client.connection_pool is not pool:
        client = self._tokenmill_client = _original_create_client(self, False)
    return client


def _brpop_read(self: Any, **options: Any) -> Any:
    try:
        return _original_brpop_read(self, **options)
    except json.JSONDecodeError as exc:  # kombu could not parse the item it popped off the list
        queue = "|".join(self.active_queues)
        dead_letters.bury(self._create_client(), queue, f"not JSON, so not a kombu message: {exc}", exc.doc)
        return True


def _deliver(self: Any, message: Any, queue: str | None) -> None:
    if queue not in keys.QUEUES or (reason := dead_letters.problem(message)) is None:
        _original_deliver(self, message, queue)
        return
    # any channel's client reaches the broker's Redis: the one acks go through
    dead_letters.bury(self.channels[0]._create_client(), queue, reason, orjson.dumps(message), message)


def apply() -> None:
    """Install the guards and the shared client (idempotent)."""
    kombu_redis.QoS.restore_unacked = _restore_unacked  # type: ignore[method-assign]
    kombu_redis.Channel._connparams = _connparams  # type: ignore[attr-defined]
    kombu_redis.Channel._create_client = _create_client  # type: ignore[attr-defined]
    kombu_redis.Channel._brpop_read = _brpop_read  # type: ignore[attr-defined]
    kombu_redis.Transport._deliver = _deliver  # type: ignore[method-assign]
