"""Bulk enqueue: batches of the ledger's enqueue script, streamed on one connection.

The producer sends a batch, builds the next while Redis runs it, and reads a batch's outcomes
only once the batches after it are sent, so Redis goes from one batch straight to the next and
never waits for the producer. Replies come back in the order the batches went out (one
connection), and a batch's outcomes are read before the caller learns of any later one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import hiredis
import redis
from redis.commands.core import Script
from redis.connection import AbstractConnection

from tokenmill import keys
from tokenmill.jobspec import JobSpec
from tokenmill.messages import task_messages

# Two batches in flight beat one by ~8%, three were slower than two (bench/enqueue.py, 200 rows).
IN_FLIGHT = 2


def enqueue_args(
    k: keys.RunKeys, partition: str, jobs: Sequence[JobSpec], max_depth: int
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``enqueue.lua`` for ``jobs`` (all of ``partition``)."""
    script_keys = [
        keys.runs(),
        k.partitions(),
        k.counts(),
        k.jobs(partition),
        keys.broker_queue("short"),
        keys.broker_queue("long"),
        k.backlog("short"),
        k.backlog("long"),
        k.stats(),
    ]
    args: list[Any] = [k.run, partition, max_depth]
    messages = task_messages(k.run, partition, [(job.job_id, job.queue) for job in jobs])
    job_key = k.job
    for job, message in zip(jobs, messages, strict=True):
        script_keys.append(job_key(job.job_id))
        args += (job.job_id, job.digest, job.source, job.queue, job.to_json(), message)
    return script_keys, args


class EnqueueStream:
    """Enqueue batches sent back to back on ``conn``; outcomes read oldest first."""

    def __init__(
        self, client: redis.Redis, conn: AbstractConnection, script: Script, k: keys.RunKeys
    ) -> None:
        self.client = client
        self.conn = conn
        self.script = script
        self.k = k
        self.sent: deque[tuple[Sequence[JobSpec], list[str], list[Any]]] = deque()

    def send(self, partition: str, jobs: Sequence[JobSpec], max_depth: int) -> None:
        """Send the enqueue script for ``jobs`` (all of ``partition``) without waiting for it."""
        script_keys, args = enqueue_args(self.k, partition, jobs, max_depth)
        # Packed by hiredis directly: redis-py's packer first re-checks every argument in Python,
        # ~1 us a row of the producer's ~15 (measured on 200-row batches of bench/enqueue.py's rows).
        command = ("EVALSHA", self.script.sha, len(script_keys), *script_keys, *args)
        self.conn.send_packed_command([hiredis.pack_command(command)])
        self.sent.append((jobs, script_keys, args))

    def read(self) -> tuple[Sequence[JobSpec], list[str]]:
        """The oldest unread batch and its outcomes, one per job: ``new``, ``backlog``, the state
        the ledger already held, or ``conflict:<source>``."""
        jobs, script_keys, args = self.sent.popleft()
        try:
            outcomes = self.conn.read_response()
        except redis.exceptions.NoScriptError:  # script cache flushed since the load: the slow way
            outcomes = self.script(script_keys, args, client=self.client)
        return jobs, [x.decode() if isinstance(x, bytes) else str(x) for x in outcomes]

    def __len__(self) -> int:
        return len(self.sent)
