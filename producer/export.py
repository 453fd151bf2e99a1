"""Export: the run's done jobs → ``DIR/<partition>.jsonl``, one training-ready row each.

Rows come in enqueue order; each job is one ledger entry, so a row can never appear twice. A
done job's row is built from Redis, a sealed one's read from its shard (``producer/export_rows``).
Every sealed shard is checked before anything is written: a missing or unreadable one stops the
export, naming the shard and its jobs. Files are written to a temporary name and renamed, so a
crash never leaves half a file. ``--format parquet`` writes ``DIR/<partition>.parquet``;
``--format openai-batch`` writes OpenAI's Batch output lines (:func:`batch_lines`), failed
and cancelled jobs included.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

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


# ``tokenmill export --format openai-batch``: OpenAI's Batch API output format, one line per
# request, so that a job moves between OpenAI's Batch API and one's own GPUs with no code.
#
# A done job is ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <a
# chat.completion>}, "error": null}`` (a choice a stop string ended also carries SGLang's
# ``matched_stop``), built from its export row (the same row whether it is read
# from Redis or from a sealed shard); a truncated one is written too, with ``finish_reason:
# "length"``, as OpenAI would return it. A failed job is the error it ended with: an answer of the
# server (an over-long prompt, an invalid request, a refused key) as ``response`` with its HTTP
# status and OpenAI's error body, any other failure (retries exhausted) as ``error``; a cancelled
# job is ``error`` with code ``batch_cancelled``. ``custom_id`` is the input line's own (the row's
# ``id``), with ``#<k>`` for sample k of ``--samples``. Ids are derived from the run and job, so
# two exports of a run give the same lines; ``created`` is the time of the export.

# The error classes that are an answer of the server, and the HTTP status it answered with.
HTTP_STATUS = {"context_length": 400, "invalid_request": 400, "unsupported_option": 400, "auth": 401}


def custom_id(row: dict[str, Any]) -> str:
    sample = row.get("sample")
    return str(row["id"]) if sample is None else f"{row['id']}#{sample}"


def _ids(run: str, job_id: str) -> tuple[str, str, str]:
    digest = hashlib.blake2b(f"{run}/{job_id}".encode(), digest_size=12).hexdigest()
    return f"batch_req_{digest}", f"req_{digest}", f"chatcmpl-{digest}"


def done_line(run: str, job_id: str, row: dict[str, Any]) -> dict[str, Any]:
    """The output line of a done job, from its export row."""
    line_id, request_id, completion_id = _ids(run, job_id)
    message = row["messages"][-1]
    usage = row.get("usage") or {}
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": row.get("logprobs"),
        "finish_reason": row.get("finish_reason"),
    }
    if row.get("matched_stop") is not None:  # SGLang's field of a choice, kept when a stop ended it
        choice["matched_stop"] = row["matched_stop"]
    body = {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": row.get("model"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    response = {"status_code": 200, "request_id": request_id, "body": body}
    return {"id": line_id, "custom_id": custom_id(row), "response": response, "error": None}


def failed_line(run: str, job_id: str, row_id: str, error_class: str, message: str) -> dict[str, Any]:
    """The output line of a failed or cancelled job (``row_id`` is its :func:`custom_id`)."""
    line_id, request_id, _ = _ids(run, job_id)
    status = HTTP_STATUS.get(error_class)
    if status is None:
        code = "batch_cancelled" if error_class == "cancelled" else error_class
        error = {"code": code, "message": message}
        return {"id": line_id, "custom_id": row_id, "response": None, "error": error}
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": error_class}}
    response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": line_id, "custom_id": row_id, "response": response, "error": None}


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
        return failed_line(run, job_id, custom_id(row), error_class, message)

    for job_id, _, row, ended in partition_rows(ledger, reader, counts, export_row, ended_line):
        if ended:
            yield row, False
        else:
            yield orjson.dumps(done_line(run, job_id, orjson.loads(row))), True


@contextmanager
def _writer(fmt: str, path: Path) -> Iterator[Callable[[bytes], object]]:
    """``write(row_json)`` for one output file of ``fmt``."""
    if fmt == "parquet":
        with ParquetRows(str(path)) as rows:
            yield rows.write
        return
    with path.open("wb") as fh:
        yield lambda row: fh.write(row + b"\n")
