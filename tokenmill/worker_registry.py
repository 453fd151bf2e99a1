"""Which queues each worker consumes: written by the workers, read by the server manager.

A worker records its queues once it is ready and forgets them when it stops; a manager that
pauses the consumers while no server is ready resumes each queue only on the workers that
consumed it (``server_mgr/consumers.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from tokenmill import keys

if TYPE_CHECKING:
    import redis


def register_worker(client: redis.Redis, worker: str, queues: list[str]) -> None:
    """Record that ``worker`` consumes ``queues`` (called by the worker once it is ready)."""
    client.hset(keys.worker_queues(), worker, orjson.dumps(sorted(queues)))


def unregister_worker(client: redis.Redis, worker: str) -> None:
    """Forget ``worker``'s queues (it is stopping, or stopped consuming for good)."""
    client.hdel(keys.worker_queues(), worker)


def registered_consumers(client: redis.Redis) -> dict[str, list[str]]:
    """Queue name -> the registered workers that consume it."""
    found: dict[str, list[str]] = {}
    for worker, raw in client.hgetall(keys.worker_queues()).items():
        try:
            queues = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        for queue in queues if isinstance(queues, list) else []:
            if queue in keys.QUEUES:
                found.setdefault(queue, []).append(worker.decode() if isinstance(worker, bytes) else worker)
    return found
