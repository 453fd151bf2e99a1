"""Recent completions of a run, a few per partition: what the outputs look like right now; and
the latest jobs each quality flag was set on (:func:`flagged_jobs`), each viewable as a sample.

Each commit puts its job at the head of its partition's recent list (``commit.lua``, at most
:data:`~tokenmill.outputs.RECENT_KEPT` ids). A sample is the job's export row, the row
``tokenmill export`` writes: built from the ledger while the job is ``done``, read from its
shard once it is ``sealed``. Reading a sample costs a few hash reads, and one shard file per
sealed sample's shard: never a walk of the run.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import orjson

from producer.export import export_row
from producer.export_rows import FIELDS, run_store
from producer.shards import ShardFile
from tokenmill.keys import FIELD_SEP
from tokenmill.ledger import Ledger
from tokenmill.outputs import RECENT_KEPT
from tokenmill.quality import SIGNALS
from tokenmill.replies import text


def recent_samples(
    ledger: Ledger, partitions: list[str], per_partition: int, results_url: str | None
) -> list[dict[str, Any]]:
    """Up to ``per_partition`` of the latest completions of each of ``partitions``, newest first:
    ``{"job_id", "partition", "source": "redis"|"shard", "truncated", "row"}`` with ``row`` the
    export row, or ``"error"`` in its place when the job's shard cannot be read."""
    pipe = ledger.r.pipeline(transaction=False)
    for partition in partitions:
        pipe.lrange(ledger.k.recent(partition), 0, RECENT_KEPT - 1)
    recent = [[x.decode() for x in ids] for ids in pipe.execute()]
    return samples_of(ledger, list(zip(partitions, recent, strict=True)), per_partition, results_url)


def flagged_jobs(ledger: Ledger, per_flag: int) -> dict[str, list[dict[str, str]]]:
    """Per quality flag, the latest ``per_flag`` jobs judged with it set, newest first:
    ``{flag: [{"partition", "job_id"}]}`` (the run's ``qworst`` lists)."""
    pipe = ledger.r.pipeline(transaction=False)
    for flag in SIGNALS:
        pipe.lrange(ledger.k.quality_worst(flag), 0, per_flag - 1)
    out: dict[str, list[dict[str, str]]] = {}
    for flag, entries in zip(SIGNALS, pipe.execute(), strict=True):
        pairs = (text(e).partition(FIELD_SEP) for e in entries)
        out[flag] = [{"partition": p, "job_id": j} for p, _, j in pairs]
    return out


def samples_of(
    ledger: Ledger, candidates: list[tuple[str, list[str]]], per_partition: int, results_url: str | None
) -> list[dict[str, Any]]:
    """The samples (as :func:`recent_samples`') of the first ``per_partition`` done or sealed
    jobs of each (partition, ids); a job not done, or not of that partition, has none."""
    pipe = ledger.r.pipeline(transaction=False)
    for _, ids in candidates:
        for job_id in ids:
            pipe.hmget(ledger.k.job(job_id), FIELDS)
    replies = iter(pipe.execute())
    picked: list[dict[str, Any]] = []
    sealed: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)  # (partition, shard) ->
    for partition, ids in candidates:
        taken = 0
        for job_id in ids:
            state, spec, result, truncated, shard = next(replies)
            if taken >= per_partition or state not in (b"done", b"sealed"):
                continue  # (a job put back to queued by `repair` is no sample)
            sample: dict[str, Any] = {"job_id": job_id, "partition": partition}
            if state == b"done":
                row = export_row(job_id, partition, orjson.loads(spec), orjson.loads(result))
                sample.update(source="redis", truncated=truncated == b"1", row=row)
            else:
                sample["source"] = "shard"
                sealed[(partition, shard.decode())].append(sample)
            picked.append(sample)
            taken += 1
    if sealed:
        _from_shards(ledger, sealed, results_url)
    return picked


def _from_shards(
    ledger: Ledger, wanted: dict[tuple[str, str], list[dict[str, Any]]], results_url: str | None
) -> None:
    """Fill each sealed sample with its row from its shard (or an ``error`` naming the shard)."""
    store = run_store(ledger, results_url)
    for (partition, shard_id), samples in wanted.items():
        by_id = {s["job_id"]: s for s in samples}
        try:
            if store is None:
                raise FileNotFoundError("the run records no result store")
            path = store.shard_path(ledger.run, partition, shard_id)
            with store.open(path) as source, ShardFile(shard_id, source) as shard:
                for row in shard.iter_rows():
                    if row.job_id in by_id:
                        by_id[row.job_id].update(truncated=row.truncated, row=orjson.loads(row.row))
                        if all("row" in s for s in samples):
                            break
        except (OSError, ValueError) as exc:
            for s in samples:
                s["error"] = f"shard {shard_id} of partition {partition} could not be read: {exc}"
        for s in samples:
            if "row" not in s and "error" not in s:
                s["error"] = f"job {s['job_id']} is not in shard {shard_id}, which the ledger names"
