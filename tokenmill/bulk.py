"""Bulk enqueue: batches of the ledger's enqueue script, streamed on one connection.

The producer sends a batch, builds the next while Redis runs it, and reads a batch's outcomes
only once the batches after it are sent, so Redis goes from one batch straight to the next and
never waits for the producer. Replies come back in the order the batches went out (one
connection), and a batch's outcomes are read before the caller learns of any later one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import redis
from redis.commands.core import Script

from tokenmill import keys, transitions
from tokenmill.jobspec import JobSpec
from tokenmill.redis_conn import CommandStream

# Two batches in flight beat one by ~8%, three were slower than two (bench/enqueue.py, 200 rows).
IN_FLIGHT = 2


class EnqueueStream:
    """Enqueue batches sent back to back on one connection; outcomes read oldest first."""

    def __init__(self, client: redis.Redis, conn: CommandStream, script: Script, k: keys.RunKeys) -> None:
        self.client = client
        self.conn = conn
        self.script = script
        self.k = k
        self.sent: deque[tuple[Sequence[JobSpec], transitions.Call[list[str]]]] = deque()

    def send(self, partition: str, jobs: Sequence[JobSpec], max_depth: int) -> None:
        """Send the enqueue script for ``jobs`` (all of ``partition``) without waiting for it."""
        call = transitions.enqueue(self.k, partition, jobs, max_depth)
        self.conn.send("EVALSHA", self.script.sha, len(call.keys), *call.keys, *call.args)
        self.sent.append((jobs, call))

    def read(self) -> tuple[Sequence[JobSpec], list[str]]:
        """The oldest unread batch and its outcomes, one per job (:func:`tokenmill.transitions.enqueue`)."""
        jobs, call = self.sent.popleft()
        try:
            outcomes = self.conn.read()
        except redis.exceptions.NoScriptError:  # script cache flushed since the load: the slow way
            outcomes = self.script(call.keys, call.args, client=self.client)
        return jobs, call.decode(outcomes)

    def __len__(self) -> int:
        return len(self.sent)
