"""Resume: republish every job that is not done, so a run continues whatever the broker lost."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from tokenmill.ledger import Ledger


@dataclass(slots=True)
class ResumeSummary:
    republished: int = 0
    reaped: int = 0
    running: int = 0
    failed: int = 0

    def line(self, run: str) -> str:
        return (
            f"run {run}: republished {self.republished} queued jobs, requeued {self.reaped} whose lease "
            f"expired; {self.running} still running under a live lease; {self.failed} failed (final)"
        )


def resume_run(client: redis.Redis, run: str) -> ResumeSummary:
    ledger = Ledger(client, run)
    summary = ResumeSummary(reaped=len(ledger.reap_expired(limit=1_000_000)))
    for partition in ledger.counts():
        queued: list[str] = []
        for job_id, (state,) in ledger.iter_jobs(partition, ("state",)):
            if state == b"queued":
                queued.append(job_id)
            elif state == b"running":
                summary.running += 1
            elif state == b"failed":
                summary.failed += 1
            if len(queued) >= 1000:
                summary.republished += ledger.republish(queued)
                queued = []
        summary.republished += ledger.republish(queued)
    return summary
