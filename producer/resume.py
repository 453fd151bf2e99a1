"""Resume: republish every job that is not done, so a run continues whatever the broker lost.

A paused run's pause is lifted first and its quality rules re-armed (:func:`producer.pause.lift`).
Jobs whose lease expired are requeued first. A queued job that waits without a message by
design (a delayed retry, or one on the backlog) is left to the promoter and the feeder; every
other queued job gets a message, up to ``max_queued`` messages per queue, and the rest go on the
backlog, so resuming a run of millions keeps the broker as light as enqueueing it did.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from producer.pause import lift
from tokenmill.ledger import Ledger, Republished


@dataclass(slots=True)
class ResumeSummary:
    republished: int = 0
    reaped: int = 0
    running: int = 0
    failed: int = 0
    backlogged: int = 0
    parked: int = 0
    unpaused: str = ""  # the reason of the pause lifted

    def add(self, done: Republished) -> None:
        self.republished += done.published + done.backlogged
        self.backlogged += done.backlogged

    def line(self, run: str) -> str:
        lifted = f"pause lifted ({self.unpaused}); " if self.unpaused else ""
        text = (
            f"run {run}: {lifted}republished {self.republished} queued jobs, requeued {self.reaped} "
            f"whose lease expired; {self.running} still running under a live lease; "
            f"{self.failed} failed (final)"
        )
        if self.backlogged:
            text += f"; {self.backlogged} of the republished wait on the backlog until the queue drains"
        if self.parked:
            text += f"; {self.parked} were already waiting (delayed retries or the backlog)"
        return text


def resume_run(client: redis.Redis, run: str, max_queued: int) -> ResumeSummary:
    ledger = Ledger(client, run)
    summary = ResumeSummary(unpaused=lift(ledger), reaped=len(ledger.reap_expired(limit=1_000_000)))
    parked = ledger.parked()
    for partition in ledger.counts():
        queued: list[str] = []
        for job_id, (state,) in ledger.iter_jobs(partition, ("state",)):
            if state == b"queued":
                if job_id in parked:
                    summary.parked += 1
                else:
                    queued.append(job_id)
            elif state == b"running":
                summary.running += 1
            elif state == b"failed":
                summary.failed += 1
            if len(queued) >= 1000:
                summary.add(ledger.republish(queued, max_depth=max_queued))
                queued = []
        summary.add(ledger.republish(queued, max_depth=max_queued))
    return summary
