"""The rows of one partition in enqueue order, each done job once: from Redis while a job is
``done``, from its shard once it is ``sealed``.

The partition's job list gives the order (a job's index in it is its ``seq``) and each job's
state, read in batches. The shards' row groups are merged by seq, a row group loaded only when
the walk reaches its first seq and dropped once passed, and a shard file kept open only while
one of its row groups still lies ahead; so memory holds a batch of jobs and the few row groups
that overlap the walk's position, however big the run. A shard row is used only for the job the
ledger says it seals (same seq, same shard id): a row of a file the ledger does not point to is
never exported. Shards sealed while the export runs are opened when the walk meets their jobs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from producer.result_store import ResultStore
from producer.shards import RowGroup, ShardFile, ShardRow
from tokenmill.errors import ResultStoreError, ShardLostError
from tokenmill.ledger import Ledger
from tokenmill.replies import text
from tokenmill.transitions import F

FIELDS = (F.STATE, F.SPEC, F.RESULT, F.TRUNCATED, F.SHARD)
ENDED_FIELDS = (F.ERROR_CLASS, F.ERROR, F.LAST_ERROR_CLASS, F.LAST_ERROR)
RowBuilder = Callable[[str, str, dict[str, Any], dict[str, Any]], dict[str, Any]]
# (job id, spec, error class, message) -> the line of a job that ended failed or cancelled
EndedBuilder = Callable[[str, dict[str, Any], str, str], dict[str, Any]]


@dataclass(slots=True)
class _Open:
    """A shard file open for reading, and how many of its row groups are still ahead."""

    stack: ExitStack
    file: ShardFile
    ahead: int


@dataclass(eq=False)
class ShardReader:
    """The sealed shards of one partition: checked up front, opened and closed as the walk goes."""

    store: ResultStore | None
    run: str
    partition: str
    groups: dict[str, list[RowGroup]] = field(default_factory=dict)  # shard id -> its row groups
    _open: dict[str, _Open] = field(default_factory=dict)

    def check(self, shard_id: str) -> list[RowGroup]:
        """Read (and check) ``shard_id``'s footer; raises if the file is missing or unreadable."""
        if self.store is None:
            raise FileNotFoundError("the run records no result store")
        with ExitStack() as stack:
            self.groups[shard_id] = self._load(stack, shard_id).groups
        return self.groups[shard_id]

    def _load(self, stack: ExitStack, shard_id: str) -> ShardFile:
        """``shard_id`` open for reading until ``stack`` closes."""
        assert self.store is not None
        path = self.store.shard_path(self.run, self.partition, shard_id)
        return stack.enter_context(ShardFile(shard_id, stack.enter_context(self.store.open(path))))

    def read(self, group: RowGroup) -> list[ShardRow]:
        """The rows of ``group``; its shard is opened for the first of its groups and closed
        after the last."""
        sid = group.shard_id
        held = self._open.get(sid)
        if held is None:
            stack = ExitStack()
            held = self._open[sid] = _Open(stack, self._load(stack, sid), len(self.groups[sid]))
        rows = held.file.read_group(group.index)
        held.ahead -= 1
        if held.ahead <= 0:
            self._open.pop(sid).stack.close()
        return rows

    def close(self) -> None:
        for held in self._open.values():
            held.stack.close()
        self._open.clear()


class GroupMerge:
    """Shard rows by seq across row groups that are loaded lazily."""

    def __init__(self, reader: ShardReader) -> None:
        self.reader = reader
        self.tie = itertools.count()
        self.ahead: list[tuple[int, int, RowGroup]] = []  # (min seq, tie, group) not loaded yet
        self.heads: list[tuple[int, int, str, ShardRow, Iterator[ShardRow]]] = []  # loaded rows

    def add(self, groups: list[RowGroup], from_seq: int = 0) -> None:
        for g in groups:
            if g.max_seq >= from_seq:
                heapq.heappush(self.ahead, (g.min_seq, next(self.tie), g))

    def take(self, seq: int, shard_id: str) -> ShardRow | None:
        """The row of ``shard_id`` for ``seq`` (None if it has none); rows before ``seq``, and rows
        no job of the ledger points to, are passed over (never exported)."""
        while self.ahead and self.ahead[0][0] <= seq:
            group = heapq.heappop(self.ahead)[2]
            self._push(group.shard_id, iter(self.reader.read(group)))
        found = None
        while self.heads and self.heads[0][0] <= seq:
            row_seq, _, sid, row, rest = heapq.heappop(self.heads)
            if row_seq == seq and sid == shard_id and found is None:
                found = row
            self._push(sid, rest)
        return found

    def _push(self, shard_id: str, rows: Iterator[ShardRow]) -> None:
        row = next(rows, None)
        if row is not None:
            heapq.heappush(self.heads, (row.seq, next(self.tie), shard_id, row, rows))


class Exported(NamedTuple):
    """One job's line: its export row (JSON), or with ``ended`` the line of a failed or
    cancelled job."""

    job_id: str
    truncated: bool
    row: bytes
    ended: bool = False


@dataclass(slots=True)
class RowCounts:
    """What a walk over one partition found."""

    from_redis: int = 0
    from_shards: int = 0
    not_done: int = 0
    cancelled: int = 0
    failed: int = 0  # written as such (openai-batch)


def sealed_by_shard(ledger: Ledger, partition: str) -> dict[str, list[str]]:
    """Shard id → the jobs the ledger says it seals (one scan of the partition's jobs)."""
    out: dict[str, list[str]] = {}
    for job_id, (state, shard) in ledger.iter_jobs(partition, (F.STATE, F.SHARD), batch=2000):
        if state == b"sealed" and shard is not None:
            out.setdefault(shard.decode(), []).append(job_id)
    return out


def jobs_of_shard(ledger: Ledger, partition: str, shard_id: str) -> list[str]:
    return sealed_by_shard(ledger, partition).get(shard_id, [])


def check_shards(ledger: Ledger, reader: ShardReader) -> dict[str, tuple[str, list[str]]]:
    """Open the footer of every sealed shard of the reader's partition; the lost ones, each with
    why and the jobs it held."""
    lost: dict[str, tuple[str, list[str]]] = {}
    for shard_id in sorted(text(x) for x in ledger.r.smembers(ledger.k.shards(reader.partition))):
        try:
            reader.check(shard_id)
        except Exception as exc:
            lost[shard_id] = (_why(reader, shard_id, exc), jobs_of_shard(ledger, reader.partition, shard_id))
    return lost


def _why(reader: ShardReader, shard_id: str, exc: BaseException) -> str:
    store = reader.store
    where = store.describe(store.shard_path(reader.run, reader.partition, shard_id)) if store else shard_id
    if isinstance(exc, FileNotFoundError):
        return f"{where} is missing"
    return f"{where} is unreadable ({type(exc).__name__}: {exc})"


def partition_rows(
    ledger: Ledger,
    reader: ShardReader,
    counts: RowCounts,
    build_row: RowBuilder,
    ended: EndedBuilder | None = None,
) -> Iterator[Exported]:
    """An :class:`Exported` for each done or sealed job of the reader's
    partition, in enqueue order; a done job's row is ``build_row(id, partition, spec, result)``
    (the sealer built a sealed one's the same way). With ``ended``, a failed or cancelled job
    is ``ended(id, spec, error class, message)`` too (counted as failed and cancelled). ``reader``
    must have checked the shards."""
    partition = reader.partition
    merge = GroupMerge(reader)
    for groups in reader.groups.values():
        merge.add(groups)
    fields = FIELDS + ENDED_FIELDS if ended is not None else FIELDS
    try:
        for seq, (job_id, (state, spec, result, truncated, shard, *why)) in enumerate(
            ledger.iter_jobs(partition, fields)
        ):
            if ended is not None and state in (b"failed", b"cancelled") and spec is not None:
                failed = state == b"failed"
                error_class, message = (why[0], why[1]) if failed else (b"cancelled", why[3])
                counts.failed += failed
                counts.cancelled += not failed
                line = ended(job_id, orjson.loads(spec), _text(error_class), _text(message))
                yield Exported(job_id, False, orjson.dumps(line), ended=True)
            elif state == b"done" and spec is not None and result is not None:
                row = build_row(job_id, partition, orjson.loads(spec), orjson.loads(result))
                counts.from_redis += 1
                yield Exported(job_id, truncated == b"1", orjson.dumps(row))
            elif state == b"sealed" and shard is not None:
                found = _sealed_row(ledger, reader, merge, seq, job_id, shard.decode())
                counts.from_shards += 1
                yield Exported(job_id, found.truncated, found.row)
            elif state == b"cancelled":
                counts.cancelled += 1
            else:
                counts.not_done += 1
    finally:
        reader.close()


def _text(raw: bytes | None) -> str:
    return raw.decode() if raw else ""


def _sealed_row(
    ledger: Ledger, reader: ShardReader, merge: GroupMerge, seq: int, job_id: str, shard_id: str
) -> ShardRow:
    try:
        if shard_id not in reader.groups:  # sealed since the export started
            merge.add(reader.check(shard_id), from_seq=seq)
        found = merge.take(seq, shard_id)  # raises for a row group that does not decode
        if found is None or found.job_id != job_id:
            raise ValueError(f"it has no row for job {job_id!r} (seq {seq})")
    except Exception as exc:
        jobs = jobs_of_shard(ledger, reader.partition, shard_id)
        raise ShardLostError(ledger.run, {shard_id: (_why(reader, shard_id, exc), jobs)}) from exc
    return found


def check_store_reachable(store: ResultStore | None, run: str) -> None:
    """Refuse (before anything reads or requeues) when the run's folder is not in ``store`` at
    all: a store not mounted, or moved, looks like every shard lost."""
    if store is not None and not store.exists(store.path(run)):
        where = store.describe(store.path(run))
        raise ResultStoreError(
            f"run {run}: its shards were sealed into {store.shown}, but {where} does not exist here; "
            "mount or reach the store at that path, or pass --results-url where the shards are now"
        )


def run_store(ledger: Ledger, override: str | None = None) -> ResultStore | None:
    """The store the run's shards are in: ``override`` if given, else the one the ledger
    recorded at the run's first seal (None: nothing was ever sealed)."""
    if override:
        return ResultStore(override)
    recorded = ledger.r.get(ledger.k.results_store())
    return ResultStore(text(recorded)) if recorded else None
