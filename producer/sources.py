"""What ``Client.enqueue`` accepts, as streams of records: dataset files, an iterable of dicts, a
pandas DataFrame or a Hugging Face ``datasets.Dataset``.

Each source is read lazily, a batch at a time, into the same :class:`~producer.readers.Record`
the file readers make, so rows go through the same validation (``normalize_row``) and an invalid
one raises the same :class:`~tokenmill.errors.InputError`, named by where it is in the object:
``rows[3]``, ``df.iloc[3]``, ``dataset[3]`` (0-based, as Python indexes them). A DataFrame's
missing values (NaN, None, NA) count as absent fields, as Parquet's nulls do, its numpy values
become plain Python ones, and a column of whole numbers that pandas made float because some rows
lack it gives integers again; a Dataset is read through Arrow, as the CLI reads a ``datasets``
directory. Neither pandas nor ``datasets`` is imported here: an object is recognised by its type's
module.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from producer.readers import BATCH_ROWS, Record, arrow_records, dataset_stem, iter_records, json_kind
from tokenmill.errors import InputError

DEFAULT_PARTITION = "default"  # the partition of rows given as Python objects, unless named


def sources(rows: Any, partition: str | None) -> Iterator[tuple[str, Iterable[Record]]]:
    """The sources in ``rows``, each as (partition, records): a path (str or ``os.PathLike``), a
    list of paths, a DataFrame, a Dataset, or an iterable of dicts. Files go to ``partition`` or
    each one's stem (as ``tokenmill enqueue FILE...``); anything else to ``partition`` or ``default``."""
    if isinstance(rows, str | os.PathLike):
        rows = [rows]
    if _is(rows, "pandas", "DataFrame"):
        yield partition or DEFAULT_PARTITION, _frame_records(rows)
    elif _is(rows, "datasets", "Dataset"):
        yield partition or DEFAULT_PARTITION, _dataset_records(rows)
    elif isinstance(rows, Mapping) or not isinstance(rows, Iterable) or isinstance(rows, bytes):
        got = (
            "a single dict (pass a list of them)" if isinstance(rows, Mapping) else f"a {type(rows).__name__}"
        )
        raise InputError("rows", f"expected dicts, a DataFrame, a Dataset or file paths, got {got}")
    elif isinstance(rows, list | tuple) and rows and all(isinstance(p, str | os.PathLike) for p in rows):
        for path in rows:
            yield partition or dataset_stem(path), _lazy_file(Path(path))
    else:
        yield partition or DEFAULT_PARTITION, _dict_records(rows)


def _is(obj: Any, package: str, name: str) -> bool:
    """Whether ``obj``'s type (or a base) is ``package``'s ``name`` (no import of the package)."""
    return any(c.__name__ == name and c.__module__.split(".")[0] == package for c in type(obj).__mro__)


def _lazy_file(path: Path) -> Iterator[Record]:
    """A file's records, opened (and checked) when the enqueue reaches it, as the CLI does."""
    yield from iter_records(path)


def _dict_records(rows: Iterable[Any]) -> Iterator[Record]:
    for i, row in enumerate(rows):
        source = f"rows[{i}]"
        if isinstance(row, str | os.PathLike):
            yield Record(source, None, "a file path among rows: pass either paths or rows, not both")
        elif isinstance(row, Mapping):
            yield Record(source, dict(row))
        else:
            yield Record(source, None, f"expected a dict, got {json_kind(row)}")


def _frame_records(df: Any) -> Iterator[Record]:
    """Rows of a DataFrame, ``BATCH_ROWS`` at a time; missing values absent, numpy values plain."""
    gaps = _ints_with_gaps(df)
    for start in range(0, len(df), BATCH_ROWS):
        for i, row in enumerate(df.iloc[start : start + BATCH_ROWS].to_dict("records"), start=start):
            data = {str(k): _plain(v) for k, v in row.items() if not _missing(v)}
            for name in gaps & data.keys():
                data[name] = int(data[name])
            yield Record(f"df.iloc[{i}]", data)


def _ints_with_gaps(df: Any) -> set[str]:
    """Float columns holding only whole numbers and missing values: pandas makes a column of
    integers float as soon as a row lacks it (``max_tokens``, ``seed``, ...); their values are
    given back as integers."""
    out = set()
    for name in df.columns:
        column = df[name]
        if column.dtype.kind == "f" and column.isna().any():
            present = column.dropna()
            if len(present) and (present % 1 == 0).all():
                out.add(str(name))
    return out


def _dataset_records(ds: Any) -> Iterator[Record]:
    """Rows of a ``datasets.Dataset`` through Arrow, as the CLI reads a saved one."""
    yield from arrow_records(ds.with_format("arrow").iter(batch_size=BATCH_ROWS), "dataset[{}]".format, 0)


def _missing(value: Any) -> bool:
    """NaN, None, pandas' NA and NaT: a DataFrame's ways of saying a row has no such field."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return True
    return type(value).__name__ in ("NAType", "NaTType")


def _plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars (how a DataFrame read from Parquet holds lists and
    numbers) turned into lists and Python numbers, at any depth."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if type(value).__module__ == "numpy":
        return _plain(value.tolist())  # an ndarray becomes a list, a numpy scalar a Python one
    return value
