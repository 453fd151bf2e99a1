"""Cancel: a run's (or one partition's) queued jobs end ``cancelled``; running jobs finish, or
with ``now`` stop at their next heartbeat (within a few seconds), keeping their checkpoints.

``cancelled`` is terminal: messages still in the broker or on the backlog for a cancelled job
are no-ops, and only ``tokenmill retry --cancelled`` brings the jobs back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import redis

from producer.scope import existing_run, partitions
from tokenmill import transitions as t


@dataclass(slots=True)
class CancelSummary:
    run: str
    partition: str | None
    now: bool
    cancelled: int = 0  # queued jobs that ended cancelled
    running: int = 0  # running jobs marked: they finish, or stop (now)

    def line(self) -> str:
        scope = f"run {self.run}" + (f" partition {self.partition}" if self.partition else "")
        text = f"{scope}: cancelled {self.cancelled} queued jobs"
        if self.running and self.now:
            text += f"; {self.running} running jobs stop within a few seconds, keeping their checkpoints"
        elif self.running:
            text += f"; {self.running} running jobs finish (cancel --now stops them)"
        if not self.cancelled and not self.running:
            text += " — nothing to cancel"
        return text + ". `tokenmill retry --cancelled` brings cancelled jobs back."

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def cancel_run(
    client: redis.Redis, run: str, partition: str | None = None, now: bool = False
) -> CancelSummary:
    """Cancel the queued jobs of ``run`` (or of its ``partition``) and mark its running ones."""
    ledger = existing_run(client, run)
    busy = [p for p, c in sorted(partitions(ledger, partition).items()) if c["queued"] or c["running"]]
    summary = CancelSummary(run, partition, now)
    for chunk in ledger.pick(busy, ("queued", "running")):
        queued, running = ledger.call(t.cancel(ledger.k, [j.job_id for j in chunk], now))
        summary.cancelled, summary.running = summary.cancelled + queued, summary.running + running
    return summary
