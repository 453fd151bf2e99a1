"""The job specs a batch's validation builds, kept on disk until the file is known good and then
enqueued from there: each line is read, normalized and routed once, and no spec is held in memory.

Building them again from the lines for the enqueue took 4 of the API's 9 s of validation and
enqueue over a 100,000-line file (bench/api.py, 2026-12-06). A spec is kept as three JSON lines
(its identity, its canonical request, its metadata: orjson never writes a raw newline), never
pickled. The file is this process's own temporary file, gone when closed.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from itertools import islice

import orjson

from producer.enqueue import BATCH
from tokenmill.jobspec import JobSpec


class SpecSpool:
    """Specs appended to a temporary file, read back :data:`~producer.enqueue.BATCH` at a time."""

    def __init__(self) -> None:
        self.fh = tempfile.TemporaryFile(prefix="tokenmill-api-spool-")

    def __enter__(self) -> SpecSpool:
        return self

    def __exit__(self, *_: object) -> None:
        self.fh.close()

    def add(self, s: JobSpec) -> None:
        who = orjson.dumps([s.job_id, s.partition, s.queue, s.source, s.digest, s.record_id, s.sample])
        self.fh.write(b"%s\n%s\n%s\n" % (who, s.request_json, s.metadata_json))

    def batches(self) -> Iterator[list[JobSpec]]:
        """Every spec added, in order, a batch at a time."""
        self.fh.seek(0)
        lines = iter(self.fh)
        triples = zip(lines, lines, lines, strict=False)
        while batch := [_spec(*three) for three in islice(triples, BATCH)]:
            yield batch


def _spec(who: bytes, request_json: bytes, metadata_json: bytes) -> JobSpec:
    job_id, partition, queue, source, digest, record_id, sample = orjson.loads(who)
    request_json, metadata_json = request_json.rstrip(b"\n"), metadata_json.rstrip(b"\n")
    request, metadata = orjson.loads(request_json), orjson.loads(metadata_json)
    return JobSpec(
        job_id,
        partition,
        queue,
        source,
        digest,
        request,
        metadata,
        record_id,
        request_json,
        metadata_json,
        sample,
    )
