"""Repair: the jobs of a lost shard go back to ``queued``, so they are generated again.

First the run's half-done seals are completed (as any sealer would). Then every sealed shard is
read whole, page checksums verified, and compared with the ledger: a shard that is missing, does
not decode, or lacks a row for a job the ledger says it seals is lost. Its jobs get their specs
back from the shard's spec file and return to ``queued`` (``unseal.lua``: counts move done →
queued), the shard leaves the partition's shard set (exports stop reading it), and the jobs'
messages are published (beyond ``max_queued`` they wait on the backlog). A job whose spec is
lost too cannot be generated again: it is named, stays sealed, and exports keep naming it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import redis

from producer.export_rows import ShardReader, _why, check_store_reachable, sealed_by_shard
from producer.result_store import ResultStore
from producer.sealing import Sealer
from producer.shards import ShardFile, SpecRow, read_specs
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.replies import text

log = logging.getLogger("tokenmill.repair")
CHUNK = 500


@dataclass(slots=True)
class RepairSummary:
    completed: int = 0  # half-done seals completed first
    checked: int = 0
    lost: dict[str, str] = field(default_factory=dict)  # shard -> why
    requeued: int = 0
    unrecoverable: dict[str, list[str]] = field(default_factory=dict)  # shard -> jobs without a spec

    def lines(self, run: str) -> list[str]:
        out = [f"run {run}: checked {self.checked} sealed shard(s); {len(self.lost)} lost"]
        if self.completed:
            out.append(f"completed {self.completed} half-done seal(s) first")
        out += [f"shard {s}: {why}" for s, why in sorted(self.lost.items())]
        if self.lost:
            out.append(f"{self.requeued} job(s) put back to queued; workers will generate them again")
        for shard_id, jobs in sorted(self.unrecoverable.items()):
            out.append(
                f"shard {shard_id}: {len(jobs)} job(s) cannot be generated again, their spec file is "
                f"lost too: {', '.join(jobs[:10])}"
            )
        return out


def shard_problem(store: ResultStore, run: str, partition: str, shard_id: str, jobs: list[str]) -> str | None:
    """Why ``shard_id`` cannot serve ``jobs`` (None when it can): read whole, checksums verified."""
    path = store.shard_path(run, partition, shard_id)
    try:
        with store.open(path) as source, ShardFile(shard_id, source) as shard:
            held = {row.job_id for row in shard.iter_rows()}
    except Exception as exc:
        return _why(ShardReader(store, run, partition), shard_id, exc)
    absent = [j for j in jobs if j not in held]
    if absent:
        return f"{store.describe(path)} lacks {len(absent)} of its jobs' rows (e.g. {absent[0]!r})"
    return None


def repair_run(
    client: redis.Redis, run: str, store: ResultStore | None, sealer: Sealer | None, max_queued: int
) -> RepairSummary:
    ledger = Ledger(client, run)
    summary = RepairSummary(completed=sealer.recover(run) if sealer is not None else 0)
    if store is None:
        return summary
    if any(client.scard(ledger.k.shards(p)) for p in ledger.counts()):
        check_store_reachable(store, run)  # else every shard would look lost and be regenerated
    for partition in sorted(ledger.counts()):
        listed = {text(x) for x in client.smembers(ledger.k.shards(partition))}
        if not listed:
            continue
        owners = sealed_by_shard(ledger, partition)
        for shard_id in sorted(listed):
            summary.checked += 1
            jobs = owners.get(shard_id, [])
            why = shard_problem(store, run, partition, shard_id, jobs)
            if why is None:
                continue
            summary.lost[shard_id] = why
            log.warning("run %s: shard %s lost: %s", run, shard_id, why)
            requeued = _unseal(ledger, store, partition, shard_id, jobs, summary)
            ledger.republish(requeued, max_depth=max_queued)
            summary.requeued += len(requeued)
    return summary


def _unseal(
    ledger: Ledger, store: ResultStore, partition: str, shard_id: str, jobs: list[str], summary: RepairSummary
) -> list[str]:
    """Put ``jobs`` of the lost ``shard_id`` back to queued from its spec file; returns those."""
    specs: dict[str, SpecRow] = {}
    try:
        with store.open(store.specs_path(ledger.run, partition, shard_id)) as source:
            specs = {s.job_id: s for s in read_specs(source)}
    except Exception as exc:
        log.error("run %s: the spec file of shard %s is lost too: %s", ledger.run, shard_id, exc)
    missing = [j for j in jobs if j not in specs]
    if missing:
        summary.unrecoverable[shard_id] = missing
    ready = [specs[j] for j in jobs if j in specs]
    chunks = [ready[i : i + CHUNK] for i in range(0, len(ready), CHUNK)] or [[]]
    for n, chunk in enumerate(chunks):
        ledger.call(t.unseal(ledger.k, partition, shard_id, chunk, last=n == len(chunks) - 1 and not missing))
    return [s.job_id for s in ready]
