"""The typed answers of the Python API (:mod:`producer.client`): a run's status, a run in the list
of runs, and what an enqueue did.

:class:`Status` and :class:`RunInfo` are the ``status --json`` and ``runs --json`` documents with
attribute access (``st.totals["done"]``); ``to_dict()`` gives the document back, as the CLI
prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from producer.enqueue import Summary
    from tokenmill.errors import IdConflictError


@dataclass(frozen=True, slots=True)
class Status:
    """A run's progress: the ``tokenmill status --json`` document (README), field by field.

    ``partitions`` maps each partition to its counts by state (``queued``, ``running``, ``done``,
    ``failed``, and ``cancelled`` once anything was cancelled) and its ``quality``; ``totals``
    sums the counts, with ``total``. ``eta_s`` is None while unknown. ``failures`` counts failed
    jobs by error class. ``quality`` is the run's (judged jobs, the rates over the partitions'
    windows); ``paused`` is ``{"reason", "at", "by"}`` while the run is paused, else None.
    """

    run: str
    partitions: dict[str, dict[str, Any]]
    totals: dict[str, int]
    tokens_per_s: float
    eta_s: float | None
    failures: dict[str, int]
    failure_messages: dict[str, str]
    stats: dict[str, int]
    servers: list[dict[str, Any]]
    admission: dict[str, dict[str, Any]]
    lengths: dict[str, Any]
    outputs: dict[str, Any]
    quality: dict[str, Any]
    paused: dict[str, Any] | None
    results: dict[str, Any]
    dead_letters: int  # poison messages set aside off the queues, of every run (tokenmill.dead_letters)
    at: float  # when it was read (unix seconds)

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Status:
        return cls(**{name: doc[name] for name in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        """The document, as ``tokenmill status --json`` prints it."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @property
    def done(self) -> int:
        return self.totals["done"]

    @property
    def total(self) -> int:
        return self.totals["total"]

    @property
    def finished(self) -> bool:
        """No job is queued or running: every job is done, failed or cancelled."""
        return self.totals["queued"] == 0 and self.totals["running"] == 0


@dataclass(frozen=True, slots=True)
class RunInfo:
    """One run of ``tokenmill runs --json``: counts, tokens, and times in unix seconds."""

    run: str
    partitions: dict[str, dict[str, int]]
    totals: dict[str, int]
    completion_tokens: int
    prompt_tokens: int
    first_enqueue_at: float | None
    last_activity_at: float | None

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RunInfo:
        return cls(**{name: doc[name] for name in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """What an enqueue did: ``new`` jobs created, ``existing`` ones already there (done, queued,
    running, failed or cancelled: a rerun adds nothing), and the details the CLI prints."""

    run: str
    new: int
    existing: int
    new_by_queue: dict[str, int] = field(default_factory=dict)
    done: int = 0  # of the existing: already done (or sealed)
    queued: int = 0  # ... queued or running
    failed: int = 0
    cancelled: int = 0
    invalid: int = 0  # rows skipped (skip_invalid=True)
    backlog: int = 0  # of the new: held in the ledger's backlog until the queue drains
    line: str = ""  # the CLI's summary line

    @classmethod
    def of(cls, run: str, summary: Summary) -> EnqueueResult:
        return cls(
            run=run,
            new=summary.total_new,
            existing=summary.done + summary.queued + summary.failed + summary.cancelled,
            new_by_queue=dict(summary.new),
            done=summary.done,
            queued=summary.queued,
            failed=summary.failed,
            cancelled=summary.cancelled,
            invalid=summary.invalid,
            backlog=summary.backlog,
            line=summary.line(run),
        )


def conflict_error(conflicts: list[IdConflictError], result: EnqueueResult) -> IdConflictError:
    """The first id conflict, noting the others and that every other row was enqueued (the CLI
    prints them all and exits 1)."""
    first = conflicts[0]
    more = f"{len(conflicts) - 1} more id conflict(s); " if len(conflicts) > 1 else ""
    first.add_note(f"{more}every other row was enqueued: {result.line}")
    return first
