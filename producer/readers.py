"""Streaming dataset readers: JSONL (optionally gzipped), Parquet, Hugging Face ``datasets`` dirs.

:func:`iter_records` yields one :class:`Record` per row and never holds a whole file in memory:
JSONL is read line by line (a line may be of any length), Parquet batch by batch, and a
``datasets`` directory (as written by ``Dataset.save_to_disk``) one Arrow IPC stream batch at a
time. Problems with the file itself (missing, unknown format, corrupt) raise
:class:`~tokenmill.errors.InputError` naming the path; a bad JSONL line is a :class:`Record` with
``error`` set, so the caller decides whether to stop or to skip it.

Only pyarrow is used here: the ``datasets`` package is heavy and is not a runtime dependency.
pyarrow itself is imported when a Parquet or Arrow source is opened (it is a tenth of a second of
every ``tokenmill enqueue`` of JSONL otherwise).
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from tokenmill.errors import InputError

if TYPE_CHECKING:
    import pyarrow as pa

JSONL_SUFFIXES = (".jsonl", ".json")
GZIP_SUFFIXES = (".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
BATCH_ROWS = 1024

_GZIP_MAGIC = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"
_READ_ERRORS = (OSError, EOFError, zlib.error)
_JSON_ARRAY = (
    "the file looks like a JSON array, not JSON Lines (one object per line); "
    "convert it first, e.g. with jq -c '.[]'"
)
_KNOWN = "expected .jsonl, .json, .jsonl.gz, .parquet or a Hugging Face datasets directory"


@dataclass(slots=True)
class Record:
    """One input row: ``data`` is the row, or ``error`` says why the row could not be read.

    ``source`` is ``"<path>:<line>"`` for JSONL and ``"<path>:row <n>"`` for Parquet and Arrow
    (both 1-based). Not frozen: one is made per row, and a frozen one took three times as long.
    """

    source: str
    data: dict[str, Any] | None
    error: str | None = None


def iter_records(path: str | Path) -> Iterator[Record]:
    """Stream the records of the dataset at ``path``.

    The path and its format are checked now (raising :class:`InputError`); rows are read lazily
    as the returned iterator is consumed.
    """
    p = Path(path)
    name = str(p)
    if not p.exists():
        raise InputError(name, "no such file or directory")
    if p.is_dir():
        return _iter_arrow_rows(name, _hf_data_files(p))
    suffix = _suffix(p)
    if suffix in GZIP_SUFFIXES:
        if _check_readable(p) != _GZIP_MAGIC:
            raise InputError(name, "not a gzip file (the name ends in .gz)")
        return _iter_jsonl(p, gzipped=True)
    if suffix in JSONL_SUFFIXES:
        _check_readable(p)
        return _iter_jsonl(p, gzipped=False)
    if suffix in PARQUET_SUFFIXES:
        _check_parquet(p)
        return _iter_parquet(p)
    raise InputError(name, f"unknown file format {suffix or '(no extension)'!r}: {_KNOWN}")


def dataset_stem(path: str | Path) -> str:
    """The name without format suffixes: ``a/b.jsonl.gz`` → ``b``; ``ds/train`` → ``train``."""
    p = Path(path)
    suffix = _suffix(p)
    known = (*GZIP_SUFFIXES, *JSONL_SUFFIXES, *PARQUET_SUFFIXES)
    if not p.is_dir() and suffix in known:
        return p.name[: -len(suffix)]
    return p.name


def json_kind(value: object) -> str:
    """How ``value`` reads as JSON, with an article: ``an object``, ``a list``, ``a string`` ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = ((dict, "an object"), (list, "a list"), (str, "a string"), ((int, float), "a number"))
    for types, kind in kinds:
        if isinstance(value, types):
            return kind
    return f"a {type(value).__name__}"


def _suffix(p: Path) -> str:
    """The lower-cased format suffix, two levels deep for ``.jsonl.gz``."""
    lower = p.name.lower()
    for suffix in GZIP_SUFFIXES:
        if lower.endswith(suffix):
            return suffix
    return p.suffix.lower()


# --- JSONL ---------------------------------------------------------------------------------------


def _check_readable(p: Path) -> bytes:
    """The first bytes of ``p``, or :class:`InputError` if it cannot be opened."""
    try:
        with p.open("rb") as f:
            return f.read(2)
    except OSError as exc:
        raise InputError(str(p), f"cannot read: {exc.strerror or exc}") from None


def _iter_jsonl(p: Path, *, gzipped: bool) -> Iterator[Record]:
    """One record per non-blank line; a line is read whole, whatever its length."""
    try:
        with gzip.open(p, "rb") if gzipped else p.open("rb") as f:
            yield from jsonl_records(str(p), f, "gzip data is corrupt" if gzipped else "read failed")
    except _READ_ERRORS as exc:
        raise InputError(str(p), f"read failed: {exc}") from None


def jsonl_records(name: str, f: Iterable[bytes], what: str = "read failed") -> Iterator[Record]:
    """The records of the JSON Lines read from ``f`` (a binary file, e.g. one of the result
    store: ``tokenmill api``'s uploads), named ``<name>:<line>``; a read error raises
    :class:`InputError` saying ``what`` failed."""
    lineno = 0
    first = True
    loads, decode_error = orjson.loads, orjson.JSONDecodeError
    try:
        for lineno, line in enumerate(f, start=1):
            if lineno == 1 and line.startswith(_BOM):
                line = line[len(_BOM) :]
            try:  # parsed first: a blank line is only looked for when parsing fails
                value = loads(line)
            except decode_error as exc:
                if not line or line.isspace():
                    continue
                record = Record(f"{name}:{lineno}", None, _describe_bad_line(line, exc))
            else:
                if type(value) is dict:
                    record = Record(f"{name}:{lineno}", value)
                else:
                    problem = f"expected a JSON object, got {json_kind(value)}"
                    record = Record(f"{name}:{lineno}", None, problem)
            if first and record.error and line.lstrip().startswith(b"["):
                raise InputError(record.source, _JSON_ARRAY)
            first = False
            yield record
    except _READ_ERRORS as exc:
        where = f"{name}:{lineno + 1}" if lineno else name
        raise InputError(where, f"{what}: {exc}") from None


def _describe_bad_line(line: bytes, exc: orjson.JSONDecodeError) -> str:
    """Invalid UTF-8 is reported as such (orjson's message for it is misleading)."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"not valid UTF-8 at byte {bad.start + 1} (0x{line[bad.start]:02x})"
    return f"invalid JSON: {exc.msg} at column {exc.colno}"


# --- Parquet -------------------------------------------------------------------------------------


def _check_parquet(p: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pq.read_metadata(p)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(str(p), f"not a readable Parquet file: {exc}") from None


def _iter_parquet(p: Path) -> Iterator[Record]:
    """Rows of a Parquet file, read ``BATCH_ROWS`` at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = str(p)
    try:
        with pq.ParquetFile(p) as pf:
            yield from arrow_records(pf.iter_batches(batch_size=BATCH_ROWS), lambda n: f"{name}:row {n}", 1)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(name, f"Parquet read failed: {exc}") from None


def arrow_records(
    batches: Iterable[pa.RecordBatch | pa.Table], named: Callable[[int], str], start: int
) -> Iterator[Record]:
    """One record per row of ``batches``, the ``n``-th (counted from ``start``) named ``named(n)``."""
    rows = chain.from_iterable(batch.to_pylist() for batch in batches)
    return (Record(named(n), row) for n, row in enumerate(rows, start))


# --- Hugging Face datasets directories -----------------------------------------------------------


def _hf_data_files(d: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, in the order ``state.json`` lists them."""
    name = str(d)
    if (d / "dataset_dict.json").is_file() and not (d / "state.json").is_file():
        raise InputError(name, _dataset_dict_problem(d))
    if not (d / "state.json").is_file():
        raise InputError(name, "is a directory but not a Hugging Face datasets directory (no state.json)")
    state = _load_json(d / "state.json")
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files
    ):
        raise InputError(f"{d / 'state.json'}", "has no valid '_data_files' list")
    paths = [d / f["filename"] for f in files]
    missing = [str(p.name) for p in paths if not p.is_file()]
    if missing:
        raise InputError(name, f"data files listed in state.json are missing: {', '.join(missing)}")
    return paths


def _dataset_dict_problem(d: Path) -> str:
    meta = _load_json(d / "dataset_dict.json")
    splits = meta.get("splits") if isinstance(meta, dict) else None
    if not isinstance(splits, list) or not splits:
        splits = sorted(c.name for c in d.iterdir() if (c / "state.json").is_file())
    listed = ", ".join(repr(s) for s in splits) or "none found"
    example = d / str(splits[0]) if splits else d / "train"
    return f"is a DatasetDict with splits {listed}; pass one split's directory, e.g. {example}"


def _load_json(p: Path) -> Any:
    try:
        return orjson.loads(p.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise InputError(str(p), f"cannot read: {exc}") from None


def _iter_arrow_rows(name: str, files: list[Path]) -> Iterator[Record]:
    """Rows of Arrow IPC stream files, numbered across files from 1."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    n = 1
    for file in files:
        try:
            with pa.OSFile(str(file), "rb") as f:
                for record in arrow_records(ipc.open_stream(f), lambda n: f"{name}:row {n}", n):
                    yield record
                    n += 1
        except (pa.ArrowException, OSError) as exc:
            problem = f"Arrow read of {file.name} failed: {exc}"
            raise InputError(f"{name}:row {n}", problem) from None
