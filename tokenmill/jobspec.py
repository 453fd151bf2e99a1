"""A job: one prompt with its sampling parameters, and its id.

The id is the record's own ``id`` scoped by partition (``<partition>:<id>``) when the row has
one, otherwise a content hash of (model, messages, sampling parameters), so the same prompt
enqueued twice, from any file, is one job. With samples (``enqueue --samples N``) a prompt is N
jobs, ``<id>#<k>``, each with a seed derived from the prompt's seed and k.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import orjson


def canonical(request: dict[str, Any]) -> bytes:
    """The request as canonical JSON: what is hashed and what is stored.

    Top-level keys are sorted and so are the messages' keys (a message means the same whatever
    its key order), but an option's value keeps its own order: the order of a JSON Schema's
    ``properties`` is the order SGLang generates them in, so two schemas that differ only there
    are two jobs, and the schema sent is the one given.
    """
    rest = {k: orjson.dumps(v) for k, v in request.items() if k not in _ASSEMBLED}
    return canonical_request(
        orjson.dumps(request.get("model")),
        orjson.dumps(request["messages"], option=orjson.OPT_SORT_KEYS),
        request.get("max_tokens"),
        rest,
    )


_ASSEMBLED = frozenset(("model", "messages", "max_tokens"))


def canonical_request(
    model_json: bytes, messages_json: bytes, max_tokens: int | None, options_json: dict[str, bytes]
) -> bytes:
    """:func:`canonical` assembled from values already serialized: the model, the messages (with
    sorted keys) and each option's value (``options_json``, name -> JSON).

    The producer uses this one to dump each prompt once and a run's options once; ids do not
    depend on which of the two built them (a test checks byte for byte). For a request whose
    options are scalars the bytes are what ``orjson.dumps(request, OPT_SORT_KEYS)`` gave before
    options could be objects, so ids of runs enqueued then do not change. It runs once per row:
    a request without options is one format, and each key's ``"name":`` is made once.
    """
    if not options_json:
        if max_tokens is None:
            return b'{"messages":%s,"model":%s}' % (messages_json, model_json)
        return b'{"max_tokens":%d,"messages":%s,"model":%s}' % (max_tokens, messages_json, model_json)
    parts = dict(options_json)
    parts["messages"] = messages_json
    parts["model"] = model_json
    if max_tokens is not None:
        parts["max_tokens"] = b"%d" % max_tokens
    return b"{" + b",".join([_key(k) + parts[k] for k in sorted(parts)]) + b"}"


@functools.cache
def _key(name: str) -> bytes:
    """``"name":`` as JSON bytes (option names are plain identifiers)."""
    return b'"%s":' % name.encode()


def content_hash(request: dict[str, Any] | bytes) -> str:
    """A stable hash of what determines the output: model, messages and sampling parameters."""
    raw = request if isinstance(request, bytes) else canonical(request)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def job_id_for(partition: str, record_id: str | None, digest: str) -> str:
    return f"{partition}:{record_id}" if record_id is not None else digest


def sample_id(job_id: str, k: int) -> str:
    """The id of sample ``k`` of the prompt whose job id (without samples) is ``job_id``."""
    return f"{job_id}#{k}"


def prompt_id(job_id: str) -> str:
    """:func:`sample_id` undone: the prompt's job id."""
    return job_id.rpartition("#")[0] or job_id


def sample_seed(seed: int | None, k: int) -> int:
    """Sample ``k``'s seed: a 31-bit hash of the prompt's seed (None when unset) and ``k``, so
    reruns get the same seeds, and no two samples, nor two base seeds' samples, share one."""
    digest = hashlib.blake2b(f"tokenmill-sample:{seed}:{k}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


@dataclass(slots=True)
class JobSpec:
    """Everything the worker needs to run a job, and where it came from.

    Not frozen: the producer builds one per row, and a frozen dataclass's ``__init__`` sets each
    of the ten fields through ``object.__setattr__`` (+0.26 us for three). Treat it as a value.
    """

    job_id: str
    partition: str
    queue: str
    source: str
    digest: str
    request: dict[str, Any]
    metadata: dict[str, Any]
    record_id: str | None
    request_json: bytes  # canonical(request)
    metadata_json: bytes
    sample: int | None = None  # k of ``enqueue --samples N``

    def to_json(self) -> bytes:
        """What the ledger stores under the job's ``spec`` field (the request is dumped once)."""
        record_id = b"null" if self.record_id is None else orjson.dumps(self.record_id)
        sample = b"" if self.sample is None else b',"sample":%d' % self.sample
        parts = (
            b'{"request":', self.request_json, b',"metadata":', self.metadata_json,
            b',"record_id":', record_id, sample, b"}",
        )  # fmt: skip
        return b"".join(parts)
