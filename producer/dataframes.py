"""A run's export rows as a ``datasets.Dataset`` or a pandas DataFrame (the optional extras
``tokenmill[datasets]`` and ``tokenmill[pandas]``).

The rows are the export's (``Client.results``), in its order. The Dataset is built through Arrow a
batch at a time, its column types inferred from the values (a key some rows lack, such as an
assistant message's ``reasoning_content`` or a metadata field, is null in the rows without it);
the DataFrame holds each row's values as they are (``messages`` a list of dicts, ``metadata`` a
dict).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from itertools import islice
from typing import Any

from tokenmill.errors import ExportError, MissingExtraError

BATCH_ROWS = 1000
COLUMNS = ("id", "partition", "messages", "finish_reason", "usage", "model", "metadata")  # of every row


def need(package: str, what: str) -> Any:
    """The module ``package``; :class:`MissingExtraError` naming the extra that installs it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        install = f"pip install 'tokenmill[{package}]'"
        raise MissingExtraError(f"{what} needs the {package} package: {install}") from None


def to_pandas(rows: Iterable[dict[str, Any]]) -> Any:
    """A DataFrame of ``rows``, one column per key."""
    pd = need("pandas", "to_pandas()")
    records = list(rows)
    return pd.DataFrame.from_records(records) if records else pd.DataFrame(columns=list(COLUMNS))


def to_dataset(run: str, rows: Iterable[dict[str, Any]]) -> Any:
    """A ``datasets.Dataset`` of ``rows``, built through Arrow ``BATCH_ROWS`` at a time."""
    datasets = need("datasets", "to_dataset()")
    import pyarrow as pa

    try:
        it = iter(rows)
        tables = [pa.Table.from_pylist(batch) for batch in iter(lambda: list(islice(it, BATCH_ROWS)), [])]
        if not tables:
            return datasets.Dataset.from_dict({c: [] for c in COLUMNS})
        table = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise ExportError(
            f"run {run}: its export rows do not fit one Arrow schema ({exc}); "
            "read them with results() or to_pandas()"
        ) from None
    return datasets.Dataset(table)
