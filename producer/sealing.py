"""Sealing: done results leave Redis for shards of the result store, each exactly once.

A shard is sealed in three steps, each one durable before the next starts:

1. **Reserve** (``seal_reserve.lua``): up to ``batch`` done results of a partition, lowest
   enqueue seq first, leave its unsealed set and are listed in a new manifest in Redis
   (``pending``). Nothing else will ever put those jobs in another shard.
2. **Write** the spec file, then the shard file, each whole or not at all
   (:meth:`ResultStore.write`). Their content is a function of the manifest's jobs, which stay
   ``done`` with their prompt and result in Redis until step 3: the files can be written again
   any number of times, by any sealer, and come out the same.
3. **Mark** (``seal.lua``, in chunks): each job becomes ``sealed`` with the shard id, its prompt
   and result dropped; the first chunk moves the manifest to ``marking`` (from then on the file
   is the only copy and is never written again), the last one to ``sealed``, which puts the
   shard in its partition's shard set.

Every pass first completes the run's pending manifests (:meth:`Sealer.recover`): a ``pending``
one is written (again) and marked, a ``marking`` one is marked for the jobs its file holds.
Exports read a job from Redis while it is ``done`` and from its shard once it is ``sealed``
(the job hash names the shard), so a crash between any two steps, or a Redis restart that loses
the last writes (the AOF replays a prefix of the transitions), leaves each result readable in
exactly one place. docs/results.md gives the whole argument.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from producer.export import export_row
from producer.export_rows import _text
from producer.result_store import Hook, ResultStore, no_hook
from producer.shards import ShardFile, ShardRow, SpecRow, shard_bytes, specs_bytes
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.counts import run_counts
from tokenmill.ledger import Executor
from tokenmill.replies import text
from tokenmill.transitions import F
from tokenmill.url_secrets import redact_url

log = logging.getLogger("tokenmill.seal")

# Where a test may kill the sealer, in protocol order (``tokenmill seal --crash-at STEP``).
STEPS = ("reserved", "specs_written", "tmp_written", "shard_written", "half_marked")
MARK_CHUNK = 250  # jobs per seal.lua call: bounds how long one call blocks Redis
READ_CHUNK = 500
_FIELDS = (F.STATE, F.SEQ, F.SPEC, F.RESULT, F.TRUNCATED, F.QUEUE, F.HASH, F.SOURCE, F.SHARD)
_Job = dict[str, Any]  # a job's _FIELDS as read (None: absent), and its "id"


def new_shard_id() -> str:
    """A short id that sorts by creation time; the random tail keeps ids unique even if Redis
    forgets a manifest whose file was already written (that file is then simply never read)."""
    ms = int(time.time() * 1000)
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while ms:
        ms, d = divmod(ms, 36)
        out = digits[d] + out
    return f"{out}-{secrets.token_hex(2)}"


@dataclass(slots=True)
class SealReport:
    """What one sealing pass did."""

    shards: int = 0
    jobs: int = 0
    bytes: int = 0
    recovered: int = 0
    other_store: dict[str, str] = field(default_factory=dict)  # run -> the store its shards are in


class Sealer:
    """Seals done results of runs into ``store`` (the export's rows); safe to run beside other sealers."""

    def __init__(
        self,
        client: redis.Redis,
        store: ResultStore,
        *,
        batch_jobs: int,
        after_s: float,
        fault: Hook = no_hook,
        on_shard: Callable[[], None] | None = None,
        mark_chunk: int = MARK_CHUNK,
    ) -> None:
        self.r = client
        self.store = store
        self.batch_jobs = batch_jobs
        self.after_ms = int(after_s * 1000)
        self.fault = fault
        self.on_shard = on_shard or (lambda: None)
        self.mark_chunk = mark_chunk
        self.warned: set[str] = set()  # runs whose shards are in another store
        self.ledger = Executor(client)

    # -- a pass -----------------------------------------------------------------------------

    def seal_runs(self, runs: Sequence[str] | None = None, force: bool = False) -> SealReport:
        """One pass over ``runs`` (default: every run in this Redis)."""
        report = SealReport()
        names = runs if runs is not None else sorted(text(x) for x in self.r.smembers(keys.runs()))
        for run in names:
            self.seal_run(run, force, report)
        return report

    def seal_run(self, run: str, force: bool, report: SealReport) -> None:
        """Complete the run's half-done seals, then seal each partition whose results are due
        (``force``: every done result now), adding to ``report``. A partition with no queued or
        running job left is always due: the end of a run is sealed without waiting."""
        k = keys.RunKeys(run)
        recorded = self.r.get(k.results_store())
        if recorded is not None and text(recorded) != self.store.url:
            self._elsewhere(report, run, text(recorded))
            return
        report.recovered += self.recover(run)
        counts = run_counts(self.r, run)
        for partition in sorted(counts):
            idle = counts[partition].get("queued", 0) + counts[partition].get("running", 0) == 0
            if not self._seal_partition(run, partition, force or idle, report):
                break

    def _seal_partition(self, run: str, partition: str, force: bool, report: SealReport) -> bool:
        """Seal the partition's due results, a shard at a time; False when the run's shards
        are in another store (nothing was done)."""
        while True:
            shard_id = new_shard_id()
            reply = self.reserve(run, partition, shard_id, force)
            verdict = reply[0]
            if verdict == "store":
                self._elsewhere(report, run, reply[1])
                return False
            if verdict != "ok":
                return True
            self.fault("reserved")
            rows, nbytes = self._write_and_mark(run, partition, shard_id, orjson.loads(reply[1]))
            report.shards += 1
            report.jobs += rows
            report.bytes += nbytes
            self.on_shard()

    def reserve(self, run: str, partition: str, shard_id: str, force: bool) -> list[str]:
        """Step 1 (``seal_reserve.lua``) for a new ``shard_id``: its reply. Sent again with the
        same id (redis-py resends a call after a connection error) it answers the same jobs."""
        k = keys.RunKeys(run)
        args = (self.batch_jobs, self.after_ms, force, self.store.url)
        return self.ledger.call(t.seal_reserve(k, partition, shard_id, *args))

    def _elsewhere(self, report: SealReport, run: str, store: str) -> None:
        """``run``'s shards are in ``store``, not this sealer's: leave it (and say so once)."""
        report.other_store[run] = store = redact_url(store)
        if run not in self.warned:
            self.warned.add(run)
            log.warning("run %s: its shards are in %s, not here; not sealed", run, store)

    # -- recovery ---------------------------------------------------------------------------

    def recover(self, run: str) -> int:
        """Complete every manifest of ``run`` a sealer left half done; returns how many."""
        k = keys.RunKeys(run)
        done = 0
        for raw in sorted(self.r.smembers(k.seals_pending())):
            shard_id = text(raw)
            manifest = {text(a): b for a, b in self.r.hgetall(k.shard(shard_id)).items()}
            if manifest.get("state") not in (b"pending", b"marking"):  # gone, or finished meanwhile
                self.r.srem(k.seals_pending(), shard_id)
                continue
            partition = text(manifest["partition"])
            ids = orjson.loads(manifest.get("jobs") or b"[]")
            self.store.remove_temporaries(run, partition, shard_id)
            log.warning("run %s: completing shard %s (%d jobs) left %s", run, shard_id, len(ids),
                        text(manifest["state"]))  # fmt: skip
            if manifest["state"] == b"pending":
                self._write_and_mark(run, partition, shard_id, ids)
            else:
                self._mark_from_file(run, partition, shard_id, ids)
            done += 1
        return done

    # -- the steps --------------------------------------------------------------------------

    def _read(self, run: str, ids: Sequence[str]) -> list[_Job]:
        k = keys.RunKeys(run)
        out: list[_Job] = []
        for start in range(0, len(ids), READ_CHUNK):
            chunk = ids[start : start + READ_CHUNK]
            pipe = self.r.pipeline(transaction=False)
            for job_id in chunk:
                pipe.hmget(k.job(job_id), list(_FIELDS))
            for j, values in zip(chunk, pipe.execute(), strict=True):
                out.append({"id": j, **dict(zip(_FIELDS, values, strict=True))})
        return out

    def _write_and_mark(self, run: str, partition: str, shard_id: str, ids: Sequence[str]) -> tuple[int, int]:
        """Steps 2 and 3 for a ``pending`` manifest; returns (rows, shard bytes)."""
        jobs = self._read(run, ids)
        if any(j[F.STATE] == b"sealed" and j[F.SHARD] == shard_id.encode() for j in jobs):
            return self._mark_from_file(run, partition, shard_id, ids)  # another sealer is marking
        done = [j for j in jobs if j[F.STATE] == b"done"]
        specs = [
            SpecRow(j["id"], int(j[F.SEQ] or 0), _text(j[F.QUEUE]), _text(j[F.HASH]), _text(j[F.SOURCE]),
                    j[F.SPEC] or b"")
            for j in done
        ]  # fmt: skip
        rows = [self._shard_row(j, partition) for j in done]
        self.store.write(self.store.specs_path(run, partition, shard_id), specs_bytes(specs))
        self.fault("specs_written")
        data = shard_bytes(rows)
        self.store.write(self.store.shard_path(run, partition, shard_id), data, self.fault)
        self.fault("shard_written")
        self._mark(run, partition, shard_id, [j["id"] for j in done], len(rows), len(data))
        return len(rows), len(data)

    def _shard_row(self, job: _Job, partition: str) -> ShardRow:
        spec = orjson.loads(job[F.SPEC] or b"{}")
        result = orjson.loads(job[F.RESULT] or b"{}")
        row = orjson.dumps(export_row(job["id"], partition, spec, result))
        return ShardRow(job["id"], int(job[F.SEQ] or 0), job[F.TRUNCATED] == b"1", row)

    def _mark(
        self, run: str, partition: str, shard_id: str, ids: Sequence[str], rows: int, nbytes: int
    ) -> None:
        """Step 3: ``seal.lua`` over ``ids`` in chunks, the last one finishing the manifest."""
        k = keys.RunKeys(run)
        step = self.mark_chunk
        chunks = [ids[i : i + step] for i in range(0, len(ids), step)] or [[]]
        for n, chunk in enumerate(chunks):
            last = n == len(chunks) - 1
            if self.ledger.call(t.seal(k, partition, shard_id, chunk, last, rows, nbytes)) < 0:
                log.warning("run %s: shard %s is no longer being sealed; stopped", run, shard_id)
                return
            if not last:
                self.fault("half_marked")

    def _mark_from_file(self, run: str, partition: str, shard_id: str, ids: Sequence[str]) -> tuple[int, int]:
        """Step 3 for a manifest whose marking began: the file is the only copy now, so only the
        jobs it holds are marked; a done job it lacks goes back to the unsealed set."""
        path = self.store.shard_path(run, partition, shard_id)
        try:
            with self.store.open(path) as source, ShardFile(shard_id, source) as shard:
                in_file = set(shard.job_ids())
            nbytes = self.store.size(path)
        except Exception as exc:  # missing or unreadable: `tokenmill repair` takes it from here
            log.error("run %s: shard %s cannot be read (%s); its sealed jobs need repair", run, shard_id, exc)
            in_file, nbytes = set(), 0
        jobs = self._read(run, ids)
        done = [j for j in jobs if j[F.STATE] == b"done"]
        strays = [j for j in done if j["id"] not in in_file]
        if strays:
            unsealed = keys.RunKeys(run).unsealed(partition)
            self.r.zadd(unsealed, {j["id"]: int(j[F.SEQ] or 0) for j in strays})
        marked = [j["id"] for j in done if j["id"] in in_file]
        self._mark(run, partition, shard_id, marked, len(in_file), nbytes)
        return len(marked), nbytes
