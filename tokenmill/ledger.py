"""The ledger's synchronous executor: :mod:`tokenmill.transitions`' calls run on redis-py (the
producer, the CLI, the upkeep), and the reads of many jobs that go with them.

The transitions themselves (scripts, KEYS, ARGV, replies) are :mod:`tokenmill.transitions`'; the
worker's event loop runs the same calls on :class:`tokenmill.ledger_async.AsyncLedger`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import count, islice
from typing import NamedTuple, TypeVar

import redis

from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.bulk import EnqueueStream
from tokenmill.counts import run_counts
from tokenmill.messages import task_message
from tokenmill.redis_conn import CommandStream
from tokenmill.replies import text
from tokenmill.transitions import F

R = TypeVar("R")
BATCH = 500  # jobs per cancel or retry call: each call blocks Redis for about a millisecond


class Executor:
    """Runs :mod:`tokenmill.transitions`' calls on a synchronous Redis client (the sealer and the
    time series use it as it is; :class:`Ledger` adds one run's reads)."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client
        self._scripts = {n: client.register_script(t.script_source(n)) for n in t.SCRIPT_NAMES}

    def call(self, call: t.Call[R]) -> R:
        if not call.script:
            return call.decode(self.r.execute_command(*call.args))  # type: ignore[no-untyped-call]
        return call.decode(self._scripts[call.script](call.keys, call.args))


class Ledger(Executor):
    """Transitions of one run's jobs, on a synchronous Redis client."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        super().__init__(client)
        self.run = run
        self.k = keys.RunKeys(run)
        self._enqueue_loaded = False

    # -- producer side ----------------------------------------------------------------------

    @contextmanager
    def enqueue_stream(self) -> Iterator[EnqueueStream]:
        """An :class:`~tokenmill.bulk.EnqueueStream` on a connection of its own for a bulk
        enqueue; the connection goes back to the pool once every reply is read (closed if not)."""
        script = self._scripts["enqueue"]
        if not self._enqueue_loaded:
            self.r.script_load(script.script)
            self._enqueue_loaded = True
        conn = CommandStream(self.r)
        try:
            yield EnqueueStream(self.r, conn, script, self.k)
        finally:
            conn.close()

    # -- the upkeep (reaper, delayed retries, backlog feeder) ---------------------------------

    def _due_ids(self, zset: str, limit: int) -> list[str]:
        """The first ``limit`` members of ``zset`` due by Redis's clock."""
        sec, usec = self.r.time()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        return [text(x) for x in self.r.zrangebyscore(zset, "-inf", now_ms, 0, limit)]

    def _due(self, zset: str, limit: int) -> Iterator[tuple[str, str, str]]:
        """(job id, partition, queue) of :meth:`_due_ids`."""
        for job_id in self._due_ids(zset, limit):
            part, queue = (
                text(x) if x else "" for x in self.r.hmget(self.k.job(job_id), F.PARTITION, F.QUEUE)
            )
            yield job_id, part, queue or "short"

    def reap_expired(self, limit: int = 500) -> list[str]:
        """Requeue jobs whose lease expired; returns their ids."""
        due = self._due(self.k.leases(), limit)
        return [job_id for job_id, p, q in due if self.call(t.reap(self.k, job_id, p, q))]

    def promote_due(self, limit: int = 500) -> int:
        """Publish delayed retries whose time has come."""
        return sum(self.call(t.promote(self.k, *due)) for due in self._due(self.k.delayed(), limit))

    def feed_backlog(self, queue: str, max_depth: int, batch: int = 1000) -> int:
        """Top the broker list of ``queue`` up to ``max_depth`` from the backlog; ids of jobs no
        longer queued (cancelled) leave it without a message."""
        k = self.k
        fed = 0
        while True:
            room = max_depth - self.r.llen(keys.broker_queue(queue))
            if room <= 0:
                return fed
            ids = [text(x) for x in self.r.lrange(k.backlog(queue), 0, min(room, batch) - 1)]
            if not ids:
                return fed
            parts = self.r.pipeline(transaction=False)
            for job_id in ids:
                parts.hmget(k.job(job_id), F.STATE, F.PARTITION)
            partitions = [text(p or b"") if state == b"queued" else None for state, p in parts.execute()]
            fed += max(0, self.call(t.feed(k, queue, ids, partitions)))

    # -- reading ----------------------------------------------------------------------------

    def counts(self) -> dict[str, dict[str, int]]:
        """``{partition: {state: n}}`` for every partition (:func:`tokenmill.counts.run_counts`)."""
        return run_counts(self.r, self.run)

    def iter_jobs(
        self, partition: str, fields: Sequence[str], batch: int = 500
    ) -> Iterator[tuple[str, list[bytes | None]]]:
        """``(job_id, [field values])`` for each job of ``partition``, in enqueue order."""
        key = self.k.jobs(partition)
        for start in count(0, batch):
            ids = [text(x) for x in self.r.lrange(key, start, start + batch - 1)]
            if not ids:
                return
            pipe = self.r.pipeline(transaction=False)
            for job_id in ids:
                pipe.hmget(self.k.job(job_id), list(fields))
            yield from zip(ids, pipe.execute(), strict=True)

    def requeue_abandoned(self, limit: int = 500) -> int:
        """Republish delivered jobs whose worker died while they waited (lease expired, still queued)."""
        ids = self._due_ids(self.k.waiting(), limit)
        if not ids:
            return 0
        self.r.zrem(self.k.waiting(), *ids)
        return self.republish(ids, front=True).published

    def job(self, job_id: str) -> dict[str, str]:
        return {text(a): text(b) for a, b in self.r.hgetall(self.k.job(job_id)).items()}

    def republish(
        self, job_ids: Iterable[str], front: bool = False, max_depth: int | None = None
    ) -> Republished:
        """Publish a message for each of ``job_ids`` that is ``queued`` (duplicates are harmless);
        with ``front``, at the consuming end of the queue (it runs next). With ``max_depth``, a job
        whose queue already holds that many messages goes on the backlog instead (the feeder
        publishes it as the queue drains)."""
        published = backlogged = 0
        ids = list(job_ids)
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            read = self.r.pipeline(transaction=False)
            for q in keys.QUEUES:
                read.llen(keys.broker_queue(q))
            for job_id in chunk:
                read.hmget(self.k.job(job_id), F.STATE, F.PARTITION, F.QUEUE)
            replies = read.execute()
            depths, fields = replies[: len(keys.QUEUES)], replies[len(keys.QUEUES) :]
            room = {
                q: len(chunk) if max_depth is None else max_depth - int(depth)
                for q, depth in zip(keys.QUEUES, depths, strict=True)
            }
            write = self.r.pipeline(transaction=False)
            for job_id, (state, part, queue) in zip(chunk, fields, strict=True):
                if state != b"queued" or not queue:
                    continue
                q = text(queue)
                if room[q] > 0:
                    push = write.rpush if front else write.lpush
                    push(keys.broker_queue(q), task_message(self.run, text(part or b""), job_id, q))
                    room[q] -= 1
                    published += 1
                else:
                    write.rpush(self.k.backlog(q), job_id)
                    backlogged += 1
            write.execute()
        return Republished(published, backlogged)

    def parked(self) -> set[str]:
        """Queued jobs that wait without a message by design: delayed retries and the backlogs."""
        pipe = self.r.pipeline(transaction=False)
        pipe.zrange(self.k.delayed(), 0, -1)
        for q in keys.QUEUES:
            pipe.lrange(self.k.backlog(q), 0, -1)
        return {text(x) for ids in pipe.execute() for x in ids}

    def pick(
        self, partitions: Iterable[str], states: Sequence[str], classes: set[str] | None = None
    ) -> Iterator[list[t.Picked]]:
        """The jobs of ``partitions`` whose state is one of ``states`` now (and, given ``classes``,
        whose failure class is one of them), in enqueue order, in batches of an operator's script
        call (:data:`BATCH`)."""
        picked = (
            t.Picked(job_id, partition, text(queue or b"short"))
            for partition in partitions
            for job_id, (state, queue, cls) in self.iter_jobs(partition, (F.STATE, F.QUEUE, F.ERROR_CLASS))
            if text(state) in states and (classes is None or text(cls or b"unknown") in classes)
        )
        yield from iter(lambda: list(islice(picked, BATCH)), [])


class Republished(NamedTuple):
    """What :meth:`Ledger.republish` did: messages published, job ids put on the backlog."""

    published: int
    backlogged: int
