"""A run's job counts per partition and state, read from its counts hash (O(partitions)).

The ledger's transitions keep the counts; this reads them, on redis-py's client or on
:class:`~tokenmill.quick_redis.QuickRedis` (``status`` and ``runs`` read with either), without
importing the ledger's executors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill import keys
from tokenmill.replies import text

if TYPE_CHECKING:
    from tokenmill.quick_redis import ReadClient


def run_counts(client: ReadClient, run: str) -> dict[str, dict[str, int]]:
    """``{partition: {state: n}}`` for every partition of ``run``. Every partition carries
    ``cancelled`` once any job of the run was cancelled."""
    k = keys.RunKeys(run)
    out = {text(p): dict.fromkeys(keys.STATES, 0) for p in client.smembers(k.partitions())}
    for field, value in client.hgetall(k.counts()).items():
        state, part = keys.split_count_field(text(field))
        out.setdefault(part, dict.fromkeys(keys.STATES, 0))[state] = int(value)
    if any(keys.CANCELLED in c for c in out.values()):
        for c in out.values():
            c.setdefault(keys.CANCELLED, 0)
    return out
