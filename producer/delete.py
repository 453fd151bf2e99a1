"""Delete: a run's keys leave Redis (and with ``--results`` its shards leave the result store).

Refused while workers still hold the run's jobs (a live lease, or delivered and waiting for
admission) or a sealer is writing one of its shards, unless forced: those would write into a
run that no longer exists. Shards go first, while the ledger still says where they are, so an
interrupted delete can simply be run again. Messages of the run still on the broker are no-ops
when a worker takes them (their job no longer exists).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

import redis

from producer.result_store import ResultStore
from tokenmill import keys
from tokenmill.errors import RunBusyError
from tokenmill.replies import text as as_text


@dataclass(slots=True)
class DeleteSummary:
    keys: int = 0
    files: int = 0
    store: str | None = None  # where the run's shards are (or were)

    def line(self, run: str, results: bool) -> str:
        text = f"run {run}: deleted {self.keys} key(s)"
        if results and self.store:
            text += f" and {self.files} file(s) under {self.store}"
        elif self.store:
            text += f"; its shards stay in {self.store} (--results deletes them)"
        return text


def delete_run(
    client: redis.Redis, run: str, *, results: bool, force: bool, store: ResultStore | None
) -> DeleteSummary:
    """Delete ``run``; ``store`` is where its shards are (None: the one its ledger records)."""
    k = keys.RunKeys(run)
    sec, usec = client.time()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    pipe = client.pipeline(transaction=False)
    pipe.zcount(k.leases(), now_ms, "+inf")
    pipe.zcount(k.waiting(), now_ms, "+inf")
    pipe.scard(k.seals_pending())
    running, waiting, sealing = pipe.execute()
    if (running or waiting or sealing) and not force:
        busy = [f"{running} job(s) running under a live lease"] if running else []
        busy += [f"{waiting} delivered and waiting for admission"] if waiting else []
        busy += [f"{sealing} shard(s) being sealed"] if sealing else []
        raise RunBusyError(
            f"run {run} is in use: {', '.join(busy)}. Stop its workers (or wait for them), or pass "
            "--force to delete it anyway (what they are writing is dropped)"
        )
    recorded = client.get(k.results_store())
    if store is None and recorded:
        store = ResultStore(as_text(recorded))
    summary = DeleteSummary(store=store.shown if store else None)
    if results and store is not None:
        summary.files = store.delete_run(run)
    found = client.scan_iter(match=f"{k.prefix}:*", count=1000)
    while batch := list(islice(found, 1000)):
        summary.keys += int(client.unlink(*batch))
    client.srem(keys.runs(), run)
    return summary
