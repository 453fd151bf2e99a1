"""What moves a batch along: one step of :func:`advance` per look, run by every API process's
background loop over the active batches, so that a restarted process (or a second one) carries
on where another stopped.

- ``validating``: the input file is read line by line and every line checked as ``tokenmill
  enqueue`` checks a Batch line (:func:`~producer.rows.normalize_row`, ``Routing.spec``), plus
  OpenAI's rules (a Batch line, unique ``custom_id``); any bad line fails the batch with
  ``errors.data`` naming each (the first :data:`MAX_ERRORS`) and nothing is enqueued. Otherwise the
  jobs the check built (kept on disk meanwhile: :func:`spool_add`) are enqueued into the
  run (named by the batch id) as ``tokenmill enqueue`` sends its own (``Enqueuer.enqueue_specs``),
  whose dedup makes enqueueing again after a crash a no-op, and the batch moves to ``in_progress``.
  The cyclic collector is paused meanwhile, as the CLI's enqueue pauses it.
- ``in_progress``: once no job is queued or running, ``finalizing``; once the window passed,
  the rest of the run is cancelled (``cancel --now``) and it ends ``expired``.
- ``cancelling``: the run's jobs are cancelled (``cancel --now``); once none runs, ``cancelled``.
- Ending (``finalizing``, ``cancelling``): the run's ``export --format openai-batch`` lines are
  written straight into the store, a done job's (answered 200) to the output file and the rest to
  the error file, in one pass; then one transition ends the batch with both ids. The files' ids
  follow from the batch's, so a finalization done again after a crash writes the same files, and
  only one transition ends the batch.

Validation and finalization hold a per-batch Redis lock (renewed while they run), so that two
processes do not do the same work side by side; correctness does not rest on it.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from typing import IO, Any

import orjson
import redis

from producer.api.batches import ENDPOINT, PARTITION, Batches
from producer.api.files import Files
from producer.enqueue import BATCH, Enqueuer, Routing, collector_paused
from producer.limits import for_servers
from producer.readers import Record, jsonl_records
from producer.rows import normalize_row
from tokenmill import keys
from tokenmill.counts import run_counts
from tokenmill.errors import InputError
from tokenmill.jobspec import JobSpec
from tokenmill.ledger import Ledger
from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.api")

MAX_ERRORS = 1000  # errors.data entries kept; the last one counts the rest
LOCK_TTL_S = 15.0
EXPIRED = ("batch_expired", "not run before the batch's completion window expired")  # a cancelled job's error


class Lifecycle:
    """The steps of every batch, over the API's Redis client, settings and files."""

    def __init__(self, r: redis.Redis, settings: Settings, files: Files, batches: Batches) -> None:
        self.r = r
        self.settings = settings
        self.files = files
        self.batches = batches

    def advance(self, batch_id: str) -> None:
        """One step of the batch's life, from whatever status it is in."""
        h = self.batches.fields(batch_id)
        status = h["status"] if h else "gone"
        if status == "validating":
            with self._locked(batch_id) as held:
                if held:
                    self._validate(batch_id, h or {})
        elif status == "in_progress":
            if self._busy(batch_id):
                if int((h or {})["expires_at"]) <= time.time():
                    self.r.hset(keys.api_batch(batch_id), "ending", "expired")
                    self._cancel(batch_id)
                return
            ending = (h or {}).get("ending") or "completed"
            now = int(time.time())
            if self.batches.move(batch_id, ("in_progress",), "finalizing", finalizing_at=now, ending=ending):
                self._end(batch_id)
        elif status in ("finalizing", "cancelling"):
            self._end(batch_id)

    def _end(self, batch_id: str) -> None:
        """Finalizing or cancelling: once nothing of the run is queued or running (cancelling
        cancels what is), export it and end the batch."""
        with self._locked(batch_id) as held:
            h = self.batches.fields(batch_id) if held else None
            if h is None or h["status"] not in ("finalizing", "cancelling"):
                return
            status = h["status"]
            if self._busy(batch_id):
                if status == "cancelling":
                    self._cancel(batch_id)
                return
            end = "cancelled" if status == "cancelling" else h.get("ending") or "completed"
            ids = self._export(batch_id, end)
            self.batches.move(batch_id, (status,), end, **{f"{end}_at": int(time.time())}, **ids)

    def _busy(self, run: str) -> int:
        """How many of the run's jobs are queued or running."""
        counts = run_counts(self.r, run).get(PARTITION, {})
        return counts.get("queued", 0) + counts.get("running", 0)

    def _has_run(self, run: str) -> bool:
        return bool(self.r.sismember(keys.runs(), run))

    def _cancel(self, run: str) -> None:
        from producer.cancel import cancel_run

        if self._has_run(run):
            cancel_run(self.r, run, now=True)

    # -- validating -------------------------------------------------------------------------

    def _records(self, file_id: str) -> Iterator[Record]:
        with self.files.store.reader(self.files.path(file_id)) as fh:
            yield from jsonl_records(file_id, fh)

    def _validate(self, batch_id: str, h: dict[str, str]) -> None:
        file_id = h["input_file_id"]
        try:
            if self.files.find(file_id) is None:
                raise InputError(file_id, "the input file was deleted")
            routing = Routing(model=self.settings.model, limits=for_servers(self.r, self.settings))
            with tempfile.TemporaryFile(prefix="tokenmill-api-spool-") as spool, collector_paused():
                errors = check_lines(self._records(file_id), routing, spool)
                if not errors:
                    enqueuer = Enqueuer(Ledger(self.r, batch_id), routing, self.settings.max_queued)
                    enqueuer.enqueue_specs(spooled(spool), PARTITION)
        except (InputError, FileNotFoundError) as exc:  # the file as a whole (a JSON array), or gone
            errors = [error_entry("invalid_file", str(exc))]
        now = int(time.time())
        if errors:
            doc = orjson.dumps({"object": "list", "data": errors}).decode()
            if self.batches.move(batch_id, ("validating",), "failed", failed_at=now, errors=doc):
                self._cancel(batch_id)  # what an enqueue cut short by the file had queued runs not
        else:
            self.batches.move(batch_id, ("validating",), "in_progress", in_progress_at=now)

    # -- ending -----------------------------------------------------------------------------

    def _export(self, batch_id: str, end: str) -> dict[str, str]:
        """Write the output and error files of the batch's run, straight into the store in one
        pass over its jobs (the ``openai-batch`` export's lines); their ids (empty: none)."""
        from producer.export import batch_lines, open_shards
        from producer.export_rows import RowCounts, run_store

        if not self._has_run(batch_id):
            return {"output_file_id": "", "error_file_id": ""}
        ledger = Ledger(self.r, batch_id)
        reader = open_shards(ledger, run_store(ledger), [PARTITION])[PARTITION]
        out_id, err_id = derived_id(batch_id, "output"), derived_id(batch_id, "error")
        sizes = {out_id: 0, err_id: 0}
        store, path = self.files.store, self.files.path
        with store.writer(path(out_id)) as out, store.writer(path(err_id)) as err:
            for line, ok in batch_lines(ledger, reader, RowCounts(), EXPIRED if end == "expired" else None):
                (out if ok else err).write(line + b"\n")
                sizes[out_id if ok else err_id] += len(line) + 1
        ids = {}
        for name, file_id in (("output_file_id", out_id), ("error_file_id", err_id)):
            if sizes[file_id]:
                self.files.record(file_id, f"{batch_id}_{name[:-8]}.jsonl", "batch_output", sizes[file_id])
            else:
                self.files.store.remove(self.files.path(file_id))
            ids[name] = file_id if sizes[file_id] else ""
        return ids

    @contextmanager
    def _locked(self, batch_id: str) -> Iterator[bool]:
        """Hold the batch's lock while the block runs (renewed every third of its TTL); yields
        whether it was taken."""
        lock = self.r.lock(keys.api_batch_lock(batch_id), timeout=LOCK_TTL_S, thread_local=False)
        if not lock.acquire(blocking=False):
            yield False
            return
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(LOCK_TTL_S / 3):
                try:
                    lock.reacquire()
                except redis.RedisError as exc:
                    log.warning("batch %s: lock not renewed: %s", batch_id, exc)

        keeper = threading.Thread(target=renew, name=f"lock-{batch_id}", daemon=True)
        keeper.start()
        try:
            yield True
        finally:
            stop.set()
            keeper.join()
            try:
                lock.release()
            except redis.RedisError:  # expired meanwhile (another may hold it now), or Redis is away
                log.warning("batch %s: lock expired before release", batch_id)


def error_entry(code: str, message: str, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """One entry of a batch's ``errors.data`` (OpenAI's ``BatchError``)."""
    return {"code": code, "line": line, "param": param, "message": message}


def derived_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: the same each time it is finalized."""
    return "file-" + hashlib.blake2b(f"{batch_id}/{kind}".encode(), digest_size=12).hexdigest()


def check_lines(records: Iterator[Record], routing: Routing, spool: IO[bytes]) -> list[dict[str, Any]]:
    """Every bad line of a Batch input file, as OpenAI's ``errors.data`` entries (the first
    :data:`MAX_ERRORS`, then one counting the rest); ``[]`` when every line is good. Until a bad
    line is found, each line's job goes into ``spool``."""
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    lines = bad = 0
    for rec in records:
        lines += 1
        checked = line_problem(rec, routing, seen)
        if isinstance(checked, JobSpec):
            if not bad:
                spool_add(spool, checked)
            continue
        bad += 1
        if len(errors) < MAX_ERRORS:
            code, param, message = checked
            errors.append(error_entry(code, message, int(rec.source.rsplit(":", 1)[1]), param))
    if bad > MAX_ERRORS:
        more = f"and {bad - MAX_ERRORS} more lines with errors (the first {MAX_ERRORS} are listed)"
        errors.append(error_entry("too_many_errors", more))
    if not lines:
        errors.append(error_entry("empty_file", "the input file has no requests"))
    return errors


# The job specs a batch's validation builds are kept on disk until the file is known good and
# then enqueued from there: each line is read, normalized and routed once, and no spec is held in
# memory. Building them again from the lines for the enqueue took 4 of the API's 9 s of validation
# and enqueue over a 100,000-line file (bench/api.py, 2026-12-06). A spec is kept as three JSON
# lines (its identity, its canonical request, its metadata: orjson never writes a raw newline),
# never pickled, in this process's own temporary file, gone when closed.


def spool_add(spool: IO[bytes], s: JobSpec) -> None:
    who = orjson.dumps([s.job_id, s.partition, s.queue, s.source, s.digest, s.record_id, s.sample])
    spool.write(b"%s\n%s\n%s\n" % (who, s.request_json, s.metadata_json))


def spooled(spool: IO[bytes]) -> Iterator[list[JobSpec]]:
    """Every spec added, in order, :data:`~producer.enqueue.BATCH` at a time."""
    spool.seek(0)
    lines = iter(spool)
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


def line_problem(rec: Record, routing: Routing, seen: set[str]) -> tuple[str, str | None, str] | JobSpec:
    """What is wrong with one line (code, param, message), or its job when nothing is."""
    if rec.error is not None or rec.data is None:
        return "invalid_json_line", None, f"line is not a JSON object: {rec.error}"
    data = rec.data
    if "custom_id" not in data or "body" not in data:
        return "invalid_request", None, "not an OpenAI Batch request (custom_id, method, url, body)"
    if data.get("url") != ENDPOINT:
        url = orjson.dumps(data.get("url")).decode()
        return "invalid_url", "url", f"url {url} is not the batch's endpoint {ENDPOINT}"
    custom_id = data["custom_id"]
    if isinstance(custom_id, str) and custom_id in seen:
        return "duplicate_custom_id", "custom_id", f"custom_id {custom_id!r} appears on an earlier line"
    try:
        spec = routing.spec(normalize_row(rec.source, data, routing.limits), PARTITION, rec.source)
    except InputError as exc:
        return "invalid_request", "body", exc.problem
    seen.add(custom_id)
    return spec
