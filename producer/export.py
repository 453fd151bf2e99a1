"""Export: the ledger's done jobs → ``DIR/<partition>.jsonl``, one training-ready row each.

Rows come in enqueue order; each job is one ledger entry, so a row can never appear twice.
Files are written to a temporary name and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tokenmill.jobspec import prompt_id
from tokenmill.ledger import Ledger

FIELDS = ("state", "spec", "result", "truncated")


@dataclass(slots=True)
class ExportSummary:
    files: dict[str, int] = field(default_factory=dict)  # path -> rows
    skipped_truncated: int = 0
    not_done: int = 0
    cancelled: int = 0


def export_row(job_id: str, partition: str, spec: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The export format of docs/architecture.md for one done job; a sample of ``enqueue
    --samples`` carries ``sample`` and its prompt's id."""
    request = spec["request"]
    assistant: dict[str, Any] = {"role": "assistant", "content": result.get("content", "")}
    if result.get("reasoning_content"):
        assistant["reasoning_content"] = result["reasoning_content"]
    usage = result.get("usage") or {}
    sample = spec.get("sample")
    row = {
        "id": spec.get("record_id") or (job_id if sample is None else prompt_id(job_id)),
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
    return row


def export_run(ledger: Ledger, out_dir: str | Path, include_truncated: bool = False) -> ExportSummary:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = ExportSummary()
    for partition in sorted(ledger.counts()):
        target = out / f"{partition}.jsonl"
        tmp = target.with_name(f".{target.name}.tmp")
        n = 0
        with tmp.open("wb") as fh:
            for job_id, (state, spec, result, truncated) in ledger.iter_jobs(partition, FIELDS):
                if state != b"done" or result is None or spec is None:
                    if state == b"cancelled":
                        summary.cancelled += 1
                    else:
                        summary.not_done += 1
                    continue
                if truncated == b"1" and not include_truncated:
                    summary.skipped_truncated += 1
                    continue
                row = export_row(job_id, partition, orjson.loads(spec), orjson.loads(result))
                fh.write(orjson.dumps(row) + b"\n")
                n += 1
        os.replace(tmp, target)
        summary.files[str(target)] = n
    return summary
