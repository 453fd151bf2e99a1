"""A job: one prompt with its sampling parameters, and its id.

The id is the record's own ``id`` scoped by partition (``<partition>:<id>``) when the row has
one, otherwise a content hash of (model, messages, sampling parameters), so the same prompt
enqueued twice, from any file, is one job.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import orjson

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "seed")


def canonical(request: dict[str, Any]) -> bytes:
    """The request as canonical JSON (sorted keys): what is hashed and what is stored."""
    return orjson.dumps(request, option=orjson.OPT_SORT_KEYS)


def content_hash(request: dict[str, Any] | bytes) -> str:
    """A stable hash of what determines the output: model, messages and sampling parameters."""
    raw = request if isinstance(request, bytes) else canonical(request)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def job_id_for(partition: str, record_id: str | None, digest: str) -> str:
    return f"{partition}:{record_id}" if record_id is not None else digest


@dataclass(frozen=True, slots=True)
class JobSpec:
    """Everything the worker needs to run a job, and where it came from."""

    job_id: str
    partition: str
    queue: str
    source: str
    digest: str
    request: dict[str, Any]
    metadata: dict[str, Any] = field(default_factory=dict)
    record_id: str | None = None
    request_json: bytes = b""

    @classmethod
    def build(
        cls,
        *,
        partition: str,
        queue: str,
        source: str,
        request: dict[str, Any],
        metadata: dict[str, Any],
        record_id: str | None,
    ) -> JobSpec:
        request_json = canonical(request)
        digest = content_hash(request_json)
        return cls(
            job_id=job_id_for(partition, record_id, digest),
            partition=partition,
            queue=queue,
            source=source,
            digest=digest,
            request=request,
            metadata=metadata,
            record_id=record_id,
            request_json=request_json,
        )

    def to_json(self) -> bytes:
        """What the ledger stores under the job's ``spec`` field (the request is dumped once)."""
        request = self.request_json or canonical(self.request)
        return b"".join(
            (
                b'{"request":', request,
                b',"metadata":', orjson.dumps(self.metadata),
                b',"record_id":', orjson.dumps(self.record_id), b"}",
            )
        )  # fmt: skip


def load_spec(raw: bytes | str) -> dict[str, Any]:
    """The stored spec: ``{"request": {...}, "metadata": {...}, "record_id": ...}``."""
    return orjson.loads(raw)
