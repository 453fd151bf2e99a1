"""Enqueue: dataset rows → job specs → route short/long → dedup → bulk publish, in batches.

Each batch is one ledger script call: the jobs that are new are created and their Celery
messages pushed in the same atomic step (or parked on the backlog when the broker already
holds ``max_queued`` messages); existing jobs are reported, never overwritten. Batches stream
on one connection (:mod:`tokenmill.bulk`): Redis runs one while the next is built.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from producer.limits import DEFAULT, Limits
from producer.options import check_request, to_json
from producer.readers import Record, dataset_stem, iter_records
from producer.rows import Row, normalize_row
from tokenmill import keys
from tokenmill.bulk import IN_FLIGHT, EnqueueStream
from tokenmill.errors import IdConflictError, InputError
from tokenmill.jobspec import JobSpec, canonical_request, content_hash, job_id_for, sample_id, sample_seed
from tokenmill.ledger import Ledger
from tokenmill.tokens import BYTES_PER_TOKEN, estimate_prompt_tokens

# Rows per enqueue script call: both the producer and Redis spend less per row on smaller calls;
# 1,000-row calls ran 20% slower than 250-row ones, 2,000-row 38%, and 100 to 250 alike.
BATCH = 200


@dataclass(frozen=True, slots=True)
class Routing:
    """How rows become requests: which queue, how many tokens, the run's request options."""

    model: str
    short_max_tokens: int = 10240
    long_max_tokens: int = 16384
    long_prompt_tokens: int = 4096
    params: Mapping[str, Any] = field(default_factory=dict)  # checked (producer.options.run_params)
    limits: Limits = DEFAULT  # the bounds rows are checked against (producer.limits.for_servers)
    _model_json: bytes = field(init=False, repr=False, compare=False)
    _params_json: dict[str, bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_model_json", orjson.dumps(self.model))
        object.__setattr__(self, "_params_json", {k: orjson.dumps(v) for k, v in self.params.items()})

    def spec(self, row: Row, partition: str, source: str) -> JobSpec:
        """The job for ``row``: its queue by estimated prompt size, its request with the row's
        own options over the run's, and its id (the row's, or the request's content hash).
        Options that do not go together, or a job past ``limits.row_bytes``, raise
        :class:`InputError` naming the row."""
        options, options_json = self._options(row, source)
        estimate = estimate_prompt_tokens(row.messages)
        if "tools" in options_json:  # the chat template renders the tool definitions too
            estimate += len(options_json["tools"]) // BYTES_PER_TOKEN
        is_long = estimate > self.long_prompt_tokens
        queue = "long" if is_long else "short"
        max_tokens = row.max_tokens or (self.long_max_tokens if is_long else self.short_max_tokens)
        if options:
            check_request(source, options, max_tokens)
        request: dict[str, Any] = {"model": self.model, "messages": row.messages, "max_tokens": max_tokens}
        request.update(options)
        request_json = canonical_request(self._model_json, row.messages_json, max_tokens, options_json)
        if (size := len(request_json) + len(row.metadata_json)) > self.limits.row_bytes:
            why = f"above {self.limits.row_bytes} (TOKENMILL_INPUT_MAX_ROW_BYTES)"
            raise InputError(source, f"the job is {size} bytes as JSON (request and metadata), {why}")
        digest = content_hash(request_json)
        return JobSpec(
            job_id_for(partition, row.record_id, digest),
            partition,
            queue,
            source,
            digest,
            request,
            row.metadata,
            row.record_id,
            request_json,
            row.metadata_json,
        )

    def _options(self, row: Row, source: str) -> tuple[Mapping[str, Any], dict[str, bytes]]:
        """The row's options over the run's, and each one's JSON (the run's dumped once)."""
        if not row.options:
            return self.params, self._params_json
        options = {**self.params, **row.options}
        options_json = {
            **self._params_json,
            **{k: to_json(source, f'"{k}"', v) for k, v in row.options.items()},
        }
        return options, options_json

    def samples(self, row: Row, partition: str, source: str, n: int) -> list[JobSpec]:
        """``n`` jobs for ``row``: the prompt's job as :meth:`spec` makes it, as sample ``k`` with
        id ``<id>#<k>`` and a seed derived from the prompt's seed and ``k``."""
        base = self.spec(row, partition, source)
        req = base.request
        _, options_json = self._options(row, source)
        out = []
        for k in range(n):
            seed = sample_seed(req.get("seed"), k)
            request_json = canonical_request(
                self._model_json, row.messages_json, req["max_tokens"], {**options_json, "seed": b"%d" % seed}
            )
            out.append(
                JobSpec(
                    sample_id(base.job_id, k),
                    partition,
                    base.queue,
                    source,
                    content_hash(request_json),
                    {**req, "seed": seed},
                    base.metadata,
                    base.record_id,
                    request_json,
                    base.metadata_json,
                    k,
                )
            )
        return out


@dataclass(slots=True)
class Summary:
    """What an enqueue did, by outcome."""

    new: Counter[str] = field(default_factory=Counter)  # by queue
    done: int = 0
    queued: int = 0
    failed: int = 0
    cancelled: int = 0
    invalid: int = 0
    conflicts: list[IdConflictError] = field(default_factory=list)
    backlog: int = 0

    @property
    def total_new(self) -> int:
        return sum(self.new.values())

    def line(self, run: str) -> str:
        queues = ", ".join(f"{q} {n}" for q, n in sorted(self.new.items())) or "none"
        text = (
            f"run {run}: {self.total_new} new ({queues}), {self.done} already done, "
            f"{self.queued} already queued or running, {self.failed} already failed, "
            f"{self.invalid} invalid, {len(self.conflicts)} id conflicts"
        )
        if self.backlog:
            text += f"; {self.backlog} held in the ledger's backlog until the queue drains"
        if self.cancelled:
            text += f"; {self.cancelled} already cancelled (tokenmill retry --cancelled brings them back)"
        if not self.total_new and not self.invalid and not self.conflicts:
            text += " — nothing to add"
        return text


@dataclass(slots=True)
class Enqueuer:
    ledger: Ledger
    routing: Routing
    max_queued: int
    skip_invalid: bool = False
    limit: int | None = None
    samples: int | None = None  # jobs per prompt (enqueue --samples)
    on_invalid: Callable[[InputError], None] | None = None
    on_progress: Callable[[int], None] | None = None
    summary: Summary = field(default_factory=Summary)

    def enqueue_file(self, path: str | Path, partition: str | None = None) -> None:
        """Enqueue every row of ``path`` into ``partition`` (default: the file's stem)."""
        part = keys.check_partition(partition or dataset_stem(path))
        self.enqueue_records(iter_records(path), part)

    def enqueue_records(self, records: Iterable[Record], partition: str) -> None:
        """Enqueue every record into ``partition`` (rows from a file, or from Python objects:
        :mod:`producer.sources`)."""
        part = keys.check_partition(partition)
        limit = self.limit
        batch: list[JobSpec] = []
        taken = 0
        with self.ledger.enqueue_stream() as stream:
            try:
                with collector_paused():
                    for rec in records:
                        if limit is not None and taken >= limit:
                            break
                        specs = self._specs(rec, part)
                        if specs is None:
                            continue
                        taken += 1
                        batch += specs
                        if len(batch) >= BATCH:
                            self._send(stream, part, batch, IN_FLIGHT)
                            batch = []
            finally:
                # Everything read before a bad row is enqueued before the error surfaces.
                self._send(stream, part, batch, 0)

    def enqueue_specs(self, batches: Iterable[list[JobSpec]], partition: str) -> None:
        """Enqueue jobs already built into ``partition``, a batch (up to :data:`BATCH` jobs) at a
        time, sent as :meth:`enqueue_records` sends its own (``tokenmill api``'s checked jobs)."""
        with self.ledger.enqueue_stream() as stream, collector_paused():
            for batch in batches:
                self._send(stream, partition, batch, IN_FLIGHT)
            self._send(stream, partition, [], 0)

    def _send(self, stream: EnqueueStream, partition: str, batch: list[JobSpec], in_flight: int) -> None:
        """Send ``batch``, then tally outcomes until at most ``in_flight`` batches are unread."""
        if batch:
            stream.send(partition, batch, self.max_queued)
        while len(stream) > in_flight:
            self._tally(*stream.read())

    def _specs(self, rec: Record, partition: str) -> list[JobSpec] | None:
        """The record's jobs; ``None`` for a bad record that is skipped (it raises otherwise)."""
        data = rec.data
        try:
            if rec.error is not None or data is None:
                raise InputError(rec.source, rec.error or "empty record")
            row = normalize_row(rec.source, data, self.routing.limits)
            if self.samples is None:
                return [self.routing.spec(row, partition, rec.source)]
            return self.routing.samples(row, partition, rec.source, self.samples)
        except InputError as exc:
            if not self.skip_invalid:
                raise
            self.summary.invalid += 1
            if self.on_invalid:
                self.on_invalid(exc)
            return None

    def _tally(self, batch: Sequence[JobSpec], outcomes: list[str]) -> None:
        s = self.summary
        new = s.new
        for spec, outcome in zip(batch, outcomes, strict=True):
            if outcome == "new":
                new[spec.queue] += 1
            elif outcome == "backlog":
                new[spec.queue] += 1
                s.backlog += 1
            elif outcome in ("done", "sealed"):
                s.done += 1
            elif outcome in ("queued", "running"):
                s.queued += 1
            elif outcome == "failed":
                s.failed += 1
            elif outcome == "cancelled":
                s.cancelled += 1
            elif outcome.startswith("conflict:"):
                s.conflicts.append(IdConflictError(spec.source, spec.job_id, outcome.split(":", 1)[1]))
        if self.on_progress:
            self.on_progress(len(batch))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for a bulk enqueue.

    Rows, specs and messages hold no reference cycles, so reference counting frees them; the
    collector's passes over each in-flight batch found nothing and cost ~8% of the producer's
    CPU (bench/enqueue.py).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
