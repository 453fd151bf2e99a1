"""The operator's ledger transitions: cancel and retry (``cancel.lua``, ``retry.lua``), in batches.

``tokenmill cancel`` and ``tokenmill retry`` pick jobs by reading the ledger; each script checks
every job's state again before it moves it, so a job that changed in between is left alone.
Like every transition, both move the per-partition counts in the same atomic step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tokenmill import keys
from tokenmill.ledger import Ledger, register
from tokenmill.messages import task_message

BATCH = 500  # jobs per script call: each call blocks Redis for about a millisecond


class Picked(NamedTuple):
    """A job an operator command acts on, with what its message needs."""

    job_id: str
    partition: str
    queue: str


@dataclass(slots=True)
class Retried:
    """What :meth:`Operations.retry` did: jobs back to ``queued`` by class, and how many of
    them wait on the backlog (the broker already held ``max_depth`` messages)."""

    by_class: Counter[str] = field(default_factory=Counter)
    backlogged: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_class.values())


class Cancelled(NamedTuple):
    """What :meth:`Operations.cancel` did: queued jobs cancelled, running jobs marked."""

    queued: int
    running: int


class Operations:
    """Cancel and retry on one run's ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.k = ledger.k
        self._cancel = register(ledger.r, "cancel")
        self._retry = register(ledger.r, "retry")

    def pick(self, partitions: Iterable[str], states: Sequence[bytes]) -> Iterator[Picked]:
        """The jobs of ``partitions`` whose state is one of ``states`` now, in enqueue order."""
        for partition in partitions:
            for job_id, (state, queue) in self.ledger.iter_jobs(partition, ("state", "queue")):
                if state in states:
                    yield Picked(job_id, partition, (queue or b"short").decode())

    def failed_class(self, partitions: Iterable[str], classes: set[str]) -> Iterator[Picked]:
        """The failed jobs of ``partitions`` whose failure class is in ``classes``."""
        for partition in partitions:
            fields = ("state", "queue", "error_class")
            for job_id, (state, queue, cls) in self.ledger.iter_jobs(partition, fields):
                if state == b"failed" and (cls or b"unknown").decode() in classes:
                    yield Picked(job_id, partition, (queue or b"short").decode())

    def cancel(self, jobs: Iterable[Picked], now: bool) -> Cancelled:
        """Queued jobs → ``cancelled``; running ones marked (stopped at their next heartbeat
        with ``now``, else left to finish)."""
        queued = running = 0
        for chunk in _chunks(jobs):
            ids = [j.job_id for j in chunk]
            q, r = self._cancel(
                [self.k.counts(), self.k.delayed(), self.k.stats(), *map(self.k.job, ids)],
                ["now" if now else "after", *ids],
            )
            queued, running = queued + int(q), running + int(r)
        return Cancelled(queued, running)

    def retry(
        self, jobs: Iterable[Picked], from_state: str, max_depth: int, classes: Iterable[str] = ()
    ) -> Retried:
        """Jobs in ``from_state`` (``failed``, of ``classes`` if given, or ``cancelled``) back to
        ``queued`` with a fresh retry budget; at most ``max_depth`` messages per broker list."""
        k = self.k
        allowed = "," + ",".join(classes) + "," if classes else ""
        script_keys = [k.counts(), k.failures(), k.retried(), k.stats()]
        script_keys += [keys.broker_queue(q) for q in keys.QUEUES]
        script_keys += [k.backlog(q) for q in keys.QUEUES]
        done = Retried()
        for chunk in _chunks(jobs):
            args: list[Any] = [from_state, max_depth, allowed]
            for job in chunk:
                args += (job.job_id, task_message(k.run, job.partition, job.job_id, job.queue))
            outcomes = self._retry([*script_keys, *(k.job(j.job_id) for j in chunk)], args)
            for raw in outcomes:
                outcome, _, cls = raw.decode().partition(":")
                if outcome:
                    done.by_class[cls] += 1
                    done.backlogged += outcome == "backlog"
        return done


def _chunks(jobs: Iterable[Picked]) -> Iterator[list[Picked]]:
    chunk: list[Picked] = []
    for job in jobs:
        chunk.append(job)
        if len(chunk) >= BATCH:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
