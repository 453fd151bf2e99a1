"""Retry: failed jobs (all, or those of the given error classes), or cancelled ones, back to
``queued`` with a fresh retry budget, published within the broker bound (``max_queued`` messages
per queue; the rest wait on the backlog for the feeder).

A job keeps its checkpoint, so a job cancelled or given up mid-stream continues where it was.
Typical use: ``--class context_length`` after the server's context length was raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from producer.scope import existing_run, partitions
from tokenmill import errors
from tokenmill import transitions as t
from tokenmill.errors import ConfigError
from tokenmill.replies import text

# Released without burning a retry, so never the class of a failed job.
_NEVER_FAILED = (errors.ShutdownError, errors.JobCancelledError)


@dataclass(slots=True)
class RetrySummary:
    run: str
    partition: str | None
    cancelled: bool
    by_class: dict[str, int] = field(default_factory=dict)
    backlogged: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_class.values())

    def line(self) -> str:
        what = "cancelled" if self.cancelled else "failed"
        scope = f"run {self.run}" + (f" partition {self.partition}" if self.partition else "")
        if not self.total:
            return f"{scope}: no {what} jobs to retry — nothing to do"
        text = f"{scope}: {self.total} {what} jobs back to queued"
        if not self.cancelled:
            text += " (" + ", ".join(f"{c} {n}" for c, n in sorted(self.by_class.items())) + ")"
        if self.backlogged:
            text += f"; {self.backlogged} wait on the backlog until the queue drains"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "partition": self.partition,
            "from": "cancelled" if self.cancelled else "failed",
            "retried": self.total,
            "by_class": self.by_class,
            "backlogged": self.backlogged,
        }


def retry_run(
    client: redis.Redis,
    run: str,
    max_queued: int,
    classes: tuple[str, ...] = (),
    partition: str | None = None,
    cancelled: bool = False,
) -> RetrySummary:
    """Send the failed (or cancelled) jobs of ``run`` back to ``queued``."""
    if cancelled and classes:
        raise ConfigError("--class picks failed jobs and --cancelled picks cancelled ones: give one")
    ledger = existing_run(client, run)
    scope = partitions(ledger, partition)
    summary = RetrySummary(run, partition, cancelled)
    state = "cancelled" if cancelled else "failed"
    if not cancelled:
        _check_classes(client, ledger.k.failures(), classes)
    busy = [p for p, c in sorted(scope.items()) if c.get(state)]
    for chunk in ledger.pick(busy, (state,), set(classes) if classes else None):
        for outcome, cls in ledger.call(t.retry(ledger.k, chunk, state, max_queued, classes)):
            if outcome:
                summary.by_class[cls] = summary.by_class.get(cls, 0) + 1
                summary.backlogged += outcome == "backlog"
    return summary


def _check_classes(client: redis.Redis, failures_key: str, classes: tuple[str, ...]) -> None:
    """Each of ``classes`` must be a failure class tokenmill knows, or one this run's jobs have."""
    current = {text(k): int(v) for k, v in client.hgetall(failures_key).items()}
    known = set(current)
    todo: list[type[errors.GenerationError]] = [errors.GenerationError]
    while todo:  # every class a job can fail with: the error_class of each concrete generation error
        error = todo.pop()
        subclasses = error.__subclasses__()
        if not subclasses and not issubclass(error, _NEVER_FAILED):
            known.add(error.error_class)
        todo.extend(subclasses)
    for cls in classes:
        if cls not in known:
            now = ", ".join(f"{c} ({n})" for c, n in sorted(current.items()) if n > 0) or "none"
            raise ConfigError(
                f"--class {cls!r} is not a failure class; this run's failed jobs have: {now}; "
                f"every class: {', '.join(sorted(known))}"
            )
