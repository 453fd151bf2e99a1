"""The shard file format: Parquet with zstd, one row per sealed job, rows in enqueue order.

A shard's columns are ``job_id``, ``seq`` (the job's index in its partition's enqueue order),
``truncated`` (it finished on ``max_tokens``) and ``row``: the export row exactly as
``tokenmill export`` writes it, as JSON text, so an export from shards is byte for byte the export
from Redis and fields added to the export row travel without a schema change. Rows are split into
row groups of at most :data:`ROW_GROUP_ROWS`, and a new group starts wherever ``seq`` jumps by
more than that: a result that finished late (a long prompt, a retried job) sits in a small group
of its own, so a reader merging shards in enqueue order holds few rows at a time.

A spec file beside each shard keeps what enqueue stored for each job (``queue``, ``hash``,
``source``, ``spec``), so the jobs of a lost shard can be generated again. Both files carry page
checksums, and readers verify them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal, NamedTuple, TypedDict

import pyarrow as pa
import pyarrow.parquet as pq

ROW_GROUP_ROWS = 256
_SHARD_FIELDS: list[pa.Field[Any]] = [
    pa.field("job_id", pa.string(), nullable=False),
    pa.field("seq", pa.int64(), nullable=False),
    pa.field("truncated", pa.bool_(), nullable=False),
    pa.field("row", pa.string(), nullable=False),
]
SHARD_SCHEMA = pa.schema(_SHARD_FIELDS)
_SPEC_FIELDS: list[pa.Field[Any]] = [
    pa.field("job_id", pa.string(), nullable=False),
    pa.field("seq", pa.int64(), nullable=False),
    pa.field("queue", pa.string(), nullable=False),
    pa.field("hash", pa.string(), nullable=False),
    pa.field("source", pa.string()),
    pa.field("spec", pa.string(), nullable=False),
]
SPEC_SCHEMA = pa.schema(_SPEC_FIELDS)
_JSON = ("row", "spec")  # text columns whose values are JSON bytes


class _WriteOptions(TypedDict):
    compression: Literal["zstd"]
    write_page_checksum: bool
    write_statistics: list[str]


_WRITE: _WriteOptions = {"compression": "zstd", "write_page_checksum": True, "write_statistics": ["seq"]}


class ShardRow(NamedTuple):
    """One sealed job's row: its id, enqueue seq, truncated flag and export row (JSON bytes)."""

    job_id: str
    seq: int
    truncated: bool
    row: bytes


class SpecRow(NamedTuple):
    """What enqueue stored for one job: enough to put it back to ``queued``."""

    job_id: str
    seq: int
    queue: str
    hash: str
    source: str
    spec: bytes


def row_groups(seqs: Sequence[int], limit: int = ROW_GROUP_ROWS) -> list[tuple[int, int]]:
    """``(start, stop)`` slices of sorted ``seqs``: at most ``limit`` rows each, split where seq
    jumps by more than ``limit``."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(seqs) + 1):
        if i == len(seqs) or i - start >= limit or seqs[i] - seqs[i - 1] > limit:
            groups.append((start, i))
            start = i
    return groups


def _table(rows: Sequence[tuple[Any, ...]], schema: pa.Schema) -> pa.Table:
    """``rows`` (tuples in ``schema``'s column order) as a table; a :data:`_JSON` column comes as
    bytes, cast to text (which checks it is UTF-8)."""
    columns = list(zip(*rows, strict=True)) or [()] * len(schema)
    arrays = [
        pa.array(c, pa.binary() if f.name in _JSON else f.type).cast(f.type)
        for f, c in zip(schema, columns, strict=True)
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


def _tuples(table: pa.Table, schema: pa.Schema) -> Iterator[tuple[Any, ...]]:
    """The rows of ``table`` as tuples in ``schema``'s column order, a :data:`_JSON` column as bytes."""
    cols = ((f, table.column(f.name)) for f in schema)
    return zip(*((c.cast(pa.binary()) if f.name in _JSON else c).to_pylist() for f, c in cols), strict=True)


def shard_bytes(rows: Sequence[ShardRow]) -> bytes:
    """A shard file holding ``rows`` (sorted by seq here)."""
    ordered = sorted(rows, key=lambda r: r.seq)
    sink = pa.BufferOutputStream()
    with pq.ParquetWriter(sink, SHARD_SCHEMA, **_WRITE) as writer:
        for start, stop in row_groups([r.seq for r in ordered]):
            writer.write_table(_table(ordered[start:stop], SHARD_SCHEMA), row_group_size=stop - start)
    return bytes(sink.getvalue())


def specs_bytes(rows: Sequence[SpecRow]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(_table(rows, SPEC_SCHEMA), sink, **_WRITE)
    return bytes(sink.getvalue())


def read_specs(source: str | IO[bytes]) -> list[SpecRow]:
    """Every row of a spec file (checksums verified)."""
    table = pq.ParquetFile(source, page_checksum_verification=True).read()
    _check_columns(table.schema, SPEC_SCHEMA)
    return [SpecRow(j, s, q, h, src or "", sp) for j, s, q, h, src, sp in _tuples(table, SPEC_SCHEMA)]


def _check_columns(schema: pa.Schema, want: pa.Schema) -> None:
    missing = [f.name for f in want if schema.get_field_index(f.name) < 0]
    if missing:
        raise ValueError(f"not a tokenmill file: column(s) {', '.join(missing)} missing")


@dataclass(frozen=True, slots=True)
class RowGroup:
    """Where one row group of a shard sits in enqueue order (it keeps no file open)."""

    shard_id: str
    index: int
    min_seq: int
    max_seq: int
    rows: int


class ShardFile:
    """A shard opened for reading: its footer is read (and checked) at once, rows on demand."""

    def __init__(self, shard_id: str, source: str | IO[bytes]) -> None:
        self.shard_id = shard_id
        self.file = pq.ParquetFile(source, page_checksum_verification=True)
        _check_columns(self.file.schema_arrow, SHARD_SCHEMA)
        meta = self.file.metadata
        self.rows = meta.num_rows
        seq_col = self.file.schema_arrow.get_field_index("seq")
        self.groups: list[RowGroup] = []
        for i in range(meta.num_row_groups):
            group = meta.row_group(i)
            stats: Any = group.column(seq_col).statistics
            if stats is None or not stats.has_min_max:
                raise ValueError(f"row group {i} has no seq statistics")
            self.groups.append(RowGroup(shard_id, i, int(stats.min), int(stats.max), group.num_rows))

    def read_group(self, index: int) -> list[ShardRow]:
        """The rows of row group ``index``, in seq order."""
        table = self.file.read_row_group(index, columns=list(SHARD_SCHEMA.names), use_threads=False)
        return [ShardRow._make(r) for r in _tuples(table, SHARD_SCHEMA)]

    def job_ids(self) -> list[str]:
        """Every job id in the shard (one column read)."""
        return [str(x) for x in self.file.read(columns=["job_id"]).column("job_id").to_pylist()]

    def iter_rows(self) -> Iterator[ShardRow]:
        for group in self.groups:
            yield from self.read_group(group.index)

    def close(self) -> None:
        """Let go of the file (pyarrow holds it open, with its metadata, until then)."""
        self.file.close()

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
