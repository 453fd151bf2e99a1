"""Export: the run's done jobs → ``DIR/<partition>.jsonl``, one training-ready row each.

Rows come in enqueue order; each job is one ledger entry, so a row can never appear twice. A
done job's row is built from Redis, a sealed one's read from its shard (``producer/export_rows``).
Every sealed shard is checked before anything is written: a missing or unreadable one stops the
export, naming the shard and its jobs. Files are written to a temporary name and renamed, so a
crash never leaves half a file. ``--format parquet`` writes ``DIR/<partition>.parquet``;
``--format openai-batch`` writes OpenAI's Batch output lines (``producer/export_batch``), failed
and cancelled jobs included.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from producer import export_batch
from producer.export_parquet import ParquetRows
from producer.export_rows import (
    RowCounts,
    ShardReader,
    check_shards,
    check_store_reachable,
    partition_rows,
)
from producer.result_store import ResultStore
from tokenmill.errors import ShardLostError
from tokenmill.jobspec import prompt_id
from tokenmill.ledger import Ledger


@dataclass(slots=True)
class ExportSummary(RowCounts):
    """What the walks over every partition found, and the files written."""

    files: dict[str, int] = field(default_factory=dict)  # path -> rows
    skipped_truncated: int = 0


def row_id(job_id: str, spec: dict[str, Any]) -> str:
    """The export row's ``id``: the input row's own, else the job's (a sample's prompt's)."""
    return spec.get("record_id") or (job_id if spec.get("sample") is None else prompt_id(job_id))


def export_row(job_id: str, partition: str, spec: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The export format of docs/architecture.md for one done job; a sample of ``enqueue
    --samples`` carries ``sample`` and its prompt's id."""
    request = spec["request"]
    content = result.get("content", "")
    tool_calls = result.get("tool_calls")
    # OpenAI's shape: an assistant turn that only called tools has null content
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not tool_calls else None,
    }
    if result.get("reasoning_content"):
        assistant["reasoning_content"] = result["reasoning_content"]
    if tool_calls:
        assistant["tool_calls"] = tool_calls
    usage = result.get("usage") or {}
    sample = spec.get("sample")
    row = {
        "id": row_id(job_id, spec),
        "partition": partition,
        "messages": [*request["messages"], assistant],
        "finish_reason": result.get("finish_reason"),
        "usage": {
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
        },
        "model": result.get("model") or request.get("model"),
        "metadata": spec.get("metadata") or {},
    }
    if sample is not None:
        row["sample"] = sample
    for name in ("matched_stop", "logprobs", "output_token_ids"):
        if result.get(name) is not None:
            row[name] = result[name]
    return row


def export_run(
    ledger: Ledger,
    out_dir: str | Path,
    include_truncated: bool = False,
    fmt: str = "jsonl",
    store: ResultStore | None = None,
) -> ExportSummary:
    """Write every done or sealed job of the run, one file per partition; ``store`` holds the
    run's shards (None: nothing was sealed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = ExportSummary()
    readers = open_shards(ledger, store)
    batch = fmt == "openai-batch"
    for partition, reader in readers.items():
        target = out / f"{partition}.{'jsonl' if batch else fmt}"
        tmp = target.with_name(f".{target.name}.tmp")
        n = 0
        rows: Iterator[tuple[bytes, bool]]  # (row, truncated)
        if batch:  # a truncated job's line is written too, as OpenAI would return it
            rows = ((line, False) for line, _ in batch_lines(ledger, reader, summary))
        else:
            rows = ((x.row, x.truncated) for x in partition_rows(ledger, reader, summary, export_row))
        try:
            with _writer(fmt, tmp) as write:
                for row, truncated in rows:
                    if truncated and not include_truncated:
                        summary.skipped_truncated += 1
                        continue
                    write(row)
                    n += 1
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, target)
        summary.files[str(target)] = n
    return summary


def open_shards(
    ledger: Ledger, store: ResultStore | None, partitions: Sequence[str] | None = None
) -> dict[str, ShardReader]:
    """A shard reader for each partition (all, or those named), in name order, every sealed
    shard checked: a missing or unreadable one raises :class:`ShardLostError` naming it and its
    jobs, before anything is read."""
    names = sorted(ledger.counts()) if partitions is None else list(partitions)
    readers = {p: ShardReader(store, ledger.run, p) for p in names}
    lost: dict[str, tuple[str, list[str]]] = {}
    for reader in readers.values():
        lost.update(check_shards(ledger, reader))
    if lost:
        check_store_reachable(store, ledger.run)
        raise ShardLostError(ledger.run, lost)
    return readers


def batch_lines(
    ledger: Ledger, reader: ShardReader, counts: RowCounts, cancelled: tuple[str, str] | None = None
) -> Iterator[tuple[bytes, bool]]:
    """The ``openai-batch`` lines (JSON) of the reader's partition, in enqueue order, each with
    whether it is a done job's (answered 200) rather than a failed or cancelled one's (its error).
    With ``cancelled`` (a code and a message), a cancelled job's error is that, not
    ``batch_cancelled``."""
    run = ledger.run

    def ended_line(job_id: str, spec: dict[str, Any], error_class: str, message: str) -> dict[str, Any]:
        if error_class == "cancelled" and cancelled is not None:
            error_class, message = cancelled
        row = {"id": row_id(job_id, spec), "sample": spec.get("sample")}
        return export_batch.failed_line(run, job_id, export_batch.custom_id(row), error_class, message)

    for job_id, _, row, ended in partition_rows(ledger, reader, counts, export_row, ended_line):
        if ended:
            yield row, False
        else:
            yield orjson.dumps(export_batch.done_line(run, job_id, orjson.loads(row))), True


@contextmanager
def _writer(fmt: str, path: Path) -> Iterator[Callable[[bytes], object]]:
    """``write(row_json)`` for one output file of ``fmt``."""
    if fmt == "parquet":
        with ParquetRows(str(path)) as rows:
            yield rows.write
        return
    with path.open("wb") as fh:
        yield lambda row: fh.write(row + b"\n")
