"""``tokenmill export --format parquet``: the export rows as a typed Parquet file per partition.

Columns follow the export row: ``id``, ``partition``, ``finish_reason`` and ``model`` are
strings; ``messages`` is a list of ``{role, content, reasoning_content, name, tool_call_id,
tool_calls}`` structs (absent keys are null; ``tool_calls`` in OpenAI's shape), what
chat-training loaders expect; ``usage`` is a struct of two integers; ``metadata`` (free-form per
row) is JSON text; ``sample``, ``matched_stop``, ``logprobs`` (OpenAI's ``{content: [{token,
logprob, bytes, top_logprobs}]}``) and ``output_token_ids`` are typed columns, null in rows
that lack them. A field the export row gains later becomes a column typed by its first value
(nested values as JSON text). Rows are written in
row groups of :data:`BATCH`, so memory stays flat. A message Parquet's struct cannot hold
(other keys, non-text content) is refused with the job named: export such a run as JSONL.
"""

from __future__ import annotations

from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.errors import ExportError

BATCH = 1000
FUNCTION_CALL = pa.struct([pa.field("name", pa.string()), pa.field("arguments", pa.string())])
TOOL_CALL = pa.struct(
    [pa.field("id", pa.string()), pa.field("type", pa.string()), pa.field("function", FUNCTION_CALL)]
)
MESSAGE_TEXT = ("role", "content", "reasoning_content", "name", "tool_call_id")
MESSAGE_KEYS = (*MESSAGE_TEXT, "tool_calls")
MESSAGE = pa.struct(
    [*(pa.field(k, pa.string()) for k in MESSAGE_TEXT), pa.field("tool_calls", pa.list_(TOOL_CALL))]
)
TOP_LOGPROB = pa.struct(
    [
        pa.field("token", pa.string()),
        pa.field("logprob", pa.float64()),
        pa.field("bytes", pa.list_(pa.int32())),
    ]
)
TOKEN_LOGPROB = pa.struct([*TOP_LOGPROB, pa.field("top_logprobs", pa.list_(TOP_LOGPROB))])
KNOWN: dict[str, pa.DataType] = {
    "id": pa.string(),
    "partition": pa.string(),
    "messages": pa.list_(MESSAGE),
    "finish_reason": pa.string(),
    "usage": pa.struct([pa.field("prompt_tokens", pa.int64()), pa.field("completion_tokens", pa.int64())]),
    "model": pa.string(),
    "metadata": pa.string(),
    "sample": pa.int64(),
    "matched_stop": pa.string(),  # a stop string, or a stop token id as its decimal text
    "logprobs": pa.struct([pa.field("content", pa.list_(TOKEN_LOGPROB))]),
    "output_token_ids": pa.list_(pa.int64()),
}
# a field the export row gains: its type by its first value's (JSON's: exact), else text
EXTRA: dict[type, pa.DataType] = {bool: pa.bool_(), int: pa.int64(), float: pa.float64()}


def _check_messages(row: dict[str, Any]) -> None:
    for i, message in enumerate(row.get("messages") or ()):
        for key, value in message.items():
            if key == "tool_calls" and isinstance(value, list):
                continue
            if key not in MESSAGE_KEYS or not isinstance(value, str | None):
                raise ExportError(
                    f"job {row.get('id')!r}: messages[{i}].{key} ({type(value).__name__}) does not fit "
                    f"the Parquet messages column ({', '.join(MESSAGE_KEYS)}: text); export this run "
                    "with --format jsonl"
                )


class ParquetRows:
    """Write export rows (JSON bytes) to ``path``; the schema is fixed by the first row."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.schema: pa.Schema | None = None
        self.writer: pq.ParquetWriter | None = None
        self.batch: list[dict[str, Any]] = []

    def write(self, row_json: bytes) -> None:
        row = orjson.loads(row_json)
        _check_messages(row)
        if self.schema is None:
            extra = [pa.field(k, EXTRA.get(type(v), pa.string())) for k, v in row.items() if k not in KNOWN]
            self.schema = pa.schema([pa.field(k, t) for k, t in KNOWN.items()] + extra)
        unknown = set(row) - set(self.schema.names)
        if unknown:
            raise ExportError(f"job {row.get('id')!r} has field(s) {sorted(unknown)} earlier rows lack")
        self.batch.append(row)
        if len(self.batch) >= BATCH:
            self._flush()

    def _flush(self) -> pq.ParquetWriter:
        """The rows held, written as a row group; the file is begun at the first (with no row at
        all, of :data:`KNOWN`'s columns: still a valid, empty file)."""
        schema = self.schema or pa.schema(KNOWN)
        columns = [pa.array([_cell(f, row.get(f.name)) for row in self.batch], f.type) for f in schema]
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, schema, compression="zstd")
        if self.batch:
            self.writer.write_table(pa.Table.from_arrays(columns, schema=schema))
            self.batch = []
        return self.writer

    def close(self) -> None:
        self._flush().close()

    def __enter__(self) -> ParquetRows:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
        elif self.writer is not None:
            self.writer.close()


def _cell(f: pa.Field[Any], value: Any) -> Any:
    if value is None:
        return None
    if f.name == "matched_stop":
        return str(value)
    if f.name == "metadata" or (pa.types.is_string(f.type) and not isinstance(value, str)):
        return orjson.dumps(value).decode()
    return value
