"""Every change Redis makes to a few keys, in the order it made them (keyspace notifications).

A test that samples a key can miss what happened between two samples; Redis publishes one
event per command that changes a key, so replaying them sees every step. One event stands for
one command, whatever the number of elements it moved (``LPUSH k a b`` is one ``lpush``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis


class KeyEvents:
    """The events of the watched keys, read as they arrive."""

    def __init__(self, pubsub: redis.client.PubSub, prefix: str) -> None:
        self.pubsub = pubsub
        self.prefix = prefix

    def read(self) -> list[tuple[str, str]]:
        """``(key, event)`` for each change since the last read, oldest first."""
        out = []
        while (msg := self.pubsub.get_message(timeout=0)) is not None:
            if msg["type"] == "message":
                out.append((msg["channel"].decode()[len(self.prefix) :], msg["data"].decode()))
        return out


@contextmanager
def key_events(client: redis.Redis, *keys: str, timeout_s: float = 10.0) -> Iterator[KeyEvents]:
    """Watch ``keys``: events of every change made after this returns (the server's setting for
    notifications is restored on exit)."""
    setting = client.config_get("notify-keyspace-events")["notify-keyspace-events"]
    client.config_set("notify-keyspace-events", "KA")
    prefix = f"__keyspace@{client.connection_pool.connection_kwargs.get('db', 0)}__:"
    pubsub = client.pubsub()
    try:
        pubsub.subscribe(*(prefix + k for k in keys))
        confirmed = 0
        deadline = time.monotonic() + timeout_s
        while confirmed < len(keys):  # changes made after the confirmations are all published
            assert time.monotonic() < deadline, f"no confirmation of the subscription to {keys}"
            msg = pubsub.get_message(timeout=0.1)
            confirmed += bool(msg and msg["type"] == "subscribe")
        yield KeyEvents(pubsub, prefix)
    finally:
        pubsub.close()
        client.config_set("notify-keyspace-events", setting)
