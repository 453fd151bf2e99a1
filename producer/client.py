"""The Python API, ``tokenmill.Client``: the producer's commands as methods, over the code the
CLI runs. Errors are tokenmill's (:mod:`tokenmill.errors`), with the CLI's messages.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import orjson

from producer.documents import EnqueueResult, RunInfo, Status, conflict_error
from tokenmill import keys
from tokenmill.errors import ConfigError
from tokenmill.settings import Settings
from tokenmill.url_secrets import redact_url

if TYPE_CHECKING:
    import os
    from collections.abc import Sequence

    import datasets
    import pandas

    from producer.cancel import CancelSummary
    from producer.export_rows import ShardReader
    from producer.resume import ResumeSummary
    from producer.retry import RetrySummary
    from tokenmill.ledger import Ledger

log = logging.getLogger("tokenmill.client")

# What Client.enqueue takes (producer.sources): rows, a DataFrame, a Dataset, or dataset files.
Rows = Union[
    Iterable[Mapping[str, Any]],
    "pandas.DataFrame",
    "datasets.Dataset",
    str,
    "os.PathLike[str]",
    "Sequence[str | os.PathLike[str]]",
]


class Client:
    """tokenmill from Python: enqueue rows into runs, watch them, read their completions back.

    Settings are the CLI's: ``TOKENMILL_*`` variables, overridden by the arguments given
    (``redis_url``, ``server_url``, or any other setting by name, e.g. ``results_url=``). Redis is
    reached (and checked) when the client is made. Usable as a context manager.
    """

    def __init__(self, redis_url: str | None = None, server_url: str | None = None, **settings: Any) -> None:
        from tokenmill import redis_conn

        self._settings = Settings.load(redis_url=redis_url, server_url=server_url, **settings)
        self._redis = redis_conn.connect(self._settings, name="tokenmill-client")

    def __repr__(self) -> str:
        return f"tokenmill.Client(redis_url={redact_url(self._settings.redis_url)!r})"

    def close(self) -> None:
        """Close the client's Redis connections."""
        self._redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- enqueue ----------------------------------------------------------------------------

    def enqueue(
        self,
        rows: Rows,
        *,
        run: str,
        partition: str | None = None,
        samples: int | None = None,
        params: Mapping[str, Any] | None = None,
        short_max_tokens: int = 10240,
        long_max_tokens: int = 16384,
        long_prompt_tokens: int = 4096,
        model: str | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        limit: int | None = None,
        skip_invalid: bool = False,
        max_queued: int | None = None,
        quality_stop: Iterable[str] = (),
    ) -> EnqueueResult:
        """Enqueue ``rows`` into ``run``, as ``tokenmill enqueue`` does (same options, same dedup
        and validation): ``rows`` is an iterable of dicts, a pandas DataFrame, a
        ``datasets.Dataset``, or one or more dataset file paths (JSONL, Parquet, a ``datasets``
        directory). Files go to ``partition`` or each file's stem, other rows to ``partition`` or
        ``default``. An invalid row raises :class:`~tokenmill.errors.InputError` naming it
        (``rows[3]``, ``df.iloc[3]``, ``dataset[3]``, ``file:line``) after the rows before it are
        enqueued, unless ``skip_invalid``; an id enqueued before with other content raises
        :class:`~tokenmill.errors.IdConflictError` once everything else is enqueued.

        ``params`` are request options for every row (``enqueue --param``; docs/usage.md, "Request
        options"), checked now (an :class:`~tokenmill.errors.InputError` names a bad one);
        ``temperature``, ``top_p`` and ``seed`` win over them, and a row's own value over both.

        ``quality_stop`` are the run's stop rules (``enqueue --quality-stop``, e.g.
        ``["repetition>0.05@200"]``; none: the ``quality_stop`` setting's), checked before
        anything is enqueued: a tripped rule pauses the run (:meth:`resume` lifts it). The run is
        judged against the ``quality_reference_url`` setting's server, if any, as ``enqueue`` does.
        """
        from producer.enqueue import Enqueuer, Routing
        from producer.limits import check_max_tokens, for_servers
        from producer.options import run_options
        from producer.pause import encode_rules, store_rules
        from producer.sources import sources
        from tokenmill import quality_drift, redis_conn
        from tokenmill.ledger import Ledger

        keys.check_run(run)
        rules = encode_rules([quality_stop] if isinstance(quality_stop, str) else quality_stop)
        default_rules = encode_rules(self._settings.quality_stop_rules)
        _check_counts(samples=samples, limit=limit, max_queued=max_queued, short_max_tokens=short_max_tokens,
                      long_max_tokens=long_max_tokens, long_prompt_tokens=long_prompt_tokens)  # fmt: skip
        limits = for_servers(self._redis, self._settings)
        check_max_tokens("short_max_tokens", "max_tokens", short_max_tokens, limits)
        check_max_tokens("long_max_tokens", "max_tokens", long_max_tokens, limits)
        options = run_options(params, {"temperature": temperature, "top_p": top_p, "seed": seed}, limits)
        if samples and samples > 1 and options.get("temperature") == 0:
            warnings.warn(
                "samples with temperature 0 (greedy decoding): the samples of a prompt will all be "
                "the same text",
                stacklevel=2,
            )
        redis_conn.warn_durability(self._redis)
        store_rules(self._redis, run, rules, default_rules)
        quality_drift.store(self._redis, run, quality_drift.chosen(self._settings, None, None))
        routing = Routing(
            model=model or self._settings.model,
            short_max_tokens=short_max_tokens,
            long_max_tokens=long_max_tokens,
            long_prompt_tokens=long_prompt_tokens,
            params=options,
            limits=limits,
        )
        enq = Enqueuer(
            Ledger(self._redis, run),
            routing,
            max_queued or self._settings.max_queued,
            skip_invalid=skip_invalid,
            limit=limit,
            samples=samples,
            on_invalid=lambda e: log.warning("skipped: %s", e),
        )
        for part, records in sources(rows, partition):
            enq.enqueue_records(records, part)
        result = EnqueueResult.of(run, enq.summary)
        if enq.summary.conflicts:
            raise conflict_error(enq.summary.conflicts, result)
        return result

    # -- watch ------------------------------------------------------------------------------

    def status(self, run: str) -> Status:
        """The run's progress: the ``tokenmill status --json`` document, as attributes
        (``st.totals["done"]``, ``st.partitions``, ``st.eta_s``, ``st.finished``)."""
        self._ledger(run)
        return self._status(run)

    def _status(self, run: str) -> Status:
        from producer.status import run_status

        return Status.from_dict(run_status(self._redis, run, self._settings.server_urls))

    def wait(
        self, run: str, progress: bool = True, timeout: float | None = None, interval: float = 1.0
    ) -> Status:
        """Block until no job of ``run`` is queued or running (or the run is paused with none
        running: see the status's ``paused``), and return its final status. With
        ``progress``, a progress bar shows on a terminal or in a notebook. After ``timeout``
        seconds (None: no limit) raises :class:`~tokenmill.errors.WaitTimeoutError`, whose
        ``status`` is the last one read. Workers do the work; this only watches."""
        from producer.waiting import wait_run

        if interval <= 0:
            raise ConfigError(f"interval must be positive, got {interval}")
        self._ledger(run)
        return wait_run(lambda: self._status(run), progress=progress, timeout_s=timeout, interval_s=interval)

    def history(self, run: str, since_ms: int | None = None) -> dict[str, Any]:
        """The run's counters over time and its servers' load and state, as the dashboard
        charts them (:func:`tokenmill.history.run_history`): columns of points, ``t`` in unix
        seconds. Everything since the run began, thinned to at most 1,500 points a series; or,
        with ``since_ms`` (a previous answer's ``cursor``), only the points added after it."""
        from tokenmill.history import run_history

        self._ledger(run)
        return run_history(self._redis, run, since_ms)

    def samples(
        self,
        run: str,
        per_partition: int = 3,
        *,
        partition: str | None = None,
        results_url: str | None = None,
        job_id: str | None = None,
    ) -> list[dict[str, Any]]:
        """A few of the run's latest completions in each partition (or in ``partition``),
        newest first: ``{"job_id", "partition", "source", "truncated", "row"}``, ``row`` being
        the export row (:meth:`results`' rows), from Redis or from the job's shard. With
        ``job_id`` (and its ``partition``), that job's sample alone (none while it is not done)."""
        from producer.samples import recent_samples, samples_of
        from producer.scope import partitions

        _check_counts(per_partition=per_partition)
        ledger = self._ledger(run)
        names = sorted(partitions(ledger, partition))
        if job_id is not None:
            if partition is None:
                raise ConfigError(f"job_id {job_id!r}: name its partition too")
            return samples_of(ledger, [(partition, [job_id])], 1, results_url)
        return recent_samples(ledger, names, per_partition, results_url)

    def flagged_jobs(self, run: str, per_flag: int = 20) -> dict[str, list[dict[str, str]]]:
        """The latest jobs each quality flag was set on, newest first (at most 20 a flag):
        ``{flag: [{"partition", "job_id"}]}``; :meth:`samples` with ``job_id`` shows one."""
        from producer.samples import flagged_jobs

        _check_counts(per_flag=per_flag)
        return flagged_jobs(self._ledger(run), per_flag)

    def runs(self) -> list[RunInfo]:
        """Every run in this Redis, newest first (``tokenmill runs --json``)."""
        from producer.runs import list_runs

        return [RunInfo.from_dict(doc) for doc in list_runs(self._redis)]

    # -- results ----------------------------------------------------------------------------

    def results(
        self,
        run: str,
        *,
        partition: str | None = None,
        include_truncated: bool = False,
        results_url: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The run's export rows, each done job once: the rows ``tokenmill export`` writes, in
        its order (partition by partition, each in enqueue order), from Redis and the sealed
        shards, streamed. Every sealed shard is checked first: a lost one raises
        :class:`~tokenmill.errors.ShardLostError`. ``results_url``: where the shards are, if
        they moved. Truncated rows (``finish_reason`` ``"length"``) are left out unless
        ``include_truncated``, as the export does; once the rows are read to the end, a
        ``UserWarning`` says how many were left out."""
        return _warned(self._export_rows(run, partition, include_truncated, results_url))

    def _export_rows(
        self, run: str, partition: str | None, include_truncated: bool, results_url: str | None
    ) -> _ExportRows:
        from producer.export import open_shards
        from producer.export_rows import run_store
        from producer.scope import partitions

        ledger = self._ledger(run)
        scope = partitions(ledger, partition)
        readers = open_shards(ledger, run_store(ledger, results_url), sorted(scope))
        return _ExportRows(ledger, readers, include_truncated)

    def to_dataset(
        self,
        run: str,
        *,
        partition: str | None = None,
        include_truncated: bool = False,
        results_url: str | None = None,
    ) -> datasets.Dataset:
        """:meth:`results` as a ``datasets.Dataset`` (``pip install 'tokenmill[datasets]'``)."""
        from producer.dataframes import to_dataset

        rows = self._export_rows(run, partition, include_truncated, results_url)
        dataset = to_dataset(run, rows)
        rows.warn(stacklevel=2)
        return dataset

    def to_pandas(
        self,
        run: str,
        *,
        partition: str | None = None,
        include_truncated: bool = False,
        results_url: str | None = None,
    ) -> pandas.DataFrame:
        """:meth:`results` as a pandas DataFrame (``pip install 'tokenmill[pandas]'``)."""
        from producer.dataframes import to_pandas

        rows = self._export_rows(run, partition, include_truncated, results_url)
        frame: pandas.DataFrame = to_pandas(rows)
        rows.warn(stacklevel=2)
        return frame

    # -- day two ----------------------------------------------------------------------------

    def retry(
        self,
        run: str,
        classes: Iterable[str] = (),
        *,
        partition: str | None = None,
        cancelled: bool = False,
        max_queued: int | None = None,
    ) -> RetrySummary:
        """Send the run's failed jobs (all, or those of the error ``classes`` given, e.g.
        ``["context_length"]``), or with ``cancelled`` its cancelled ones, back to queued with a
        fresh retry budget (``tokenmill retry``)."""
        from producer.retry import retry_run

        if isinstance(classes, str):
            classes = [classes]
        _check_counts(max_queued=max_queued)
        return retry_run(
            self._redis,
            run,
            max_queued or self._settings.max_queued,
            classes=tuple(dict.fromkeys(classes)),
            partition=partition,
            cancelled=cancelled,
        )

    def cancel(self, run: str, now: bool = False, *, partition: str | None = None) -> CancelSummary:
        """Cancel the run's queued jobs; running ones finish, or with ``now`` stop within seconds
        keeping their checkpoints (``tokenmill cancel``). ``retry(run, cancelled=True)`` brings
        them back."""
        from producer.cancel import cancel_run

        return cancel_run(self._redis, run, partition, now)

    def pause(self, run: str, reason: str | None = None) -> bool:
        """Pause the run (``tokenmill pause``): nothing more is claimed, running jobs finish,
        nothing is lost. True when it was paused now, False when it already was (that pause, a
        person's or a quality rule's, is kept); :meth:`status`'s ``paused`` says which."""
        from producer.pause import pause_run

        return pause_run(self._ledger(run), reason)[0]

    def resume(self, run: str, max_queued: int | None = None) -> ResumeSummary:
        """Lift the run's pause, if any (its quality rules count again from now), and republish
        every job of it that is not done (``tokenmill resume``)."""
        from producer.resume import resume_run

        _check_counts(max_queued=max_queued)
        self._ledger(run)
        return resume_run(self._redis, run, max_queued or self._settings.max_queued)

    def _ledger(self, run: str) -> Ledger:
        """The run's ledger; :class:`ConfigError` naming the run if this Redis has none."""
        from producer.scope import existing_run

        return existing_run(self._redis, run)


@dataclass(slots=True)
class _ExportRows:
    """The export rows of ``readers`` as dicts, streamed; without ``include_truncated``, the
    truncated ones (``finish_reason`` ``"length"``) are left out and counted in ``left_out``."""

    ledger: Ledger
    readers: dict[str, ShardReader]
    include_truncated: bool
    left_out: int = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from producer.export import export_row
        from producer.export_rows import RowCounts, partition_rows

        for reader in self.readers.values():  # the rows ``export_run`` writes, in its order
            for line in partition_rows(self.ledger, reader, RowCounts(), export_row):
                row = orjson.loads(line.row)
                if not self.include_truncated and row.get("finish_reason") == "length":
                    self.left_out += 1
                    continue
                yield row

    def warn(self, stacklevel: int) -> None:
        """A ``UserWarning`` naming how many truncated rows were left out, if any (``stacklevel``
        as ``warnings.warn``'s, counted from the caller of this method)."""
        if self.left_out:
            warnings.warn(
                f"run {self.ledger.run}: {self.left_out} truncated row(s) (finish_reason 'length', cut at "
                "max_tokens) left out; pass include_truncated=True to include them",
                UserWarning,
                stacklevel=stacklevel + 1,
            )


def _warned(rows: _ExportRows) -> Iterator[dict[str, Any]]:
    """``rows``, then the warning naming the truncated rows they left out."""
    yield from rows
    rows.warn(stacklevel=2)  # the code that read the last row


def _check_counts(**values: int | None) -> None:
    """Each value given must be a positive integer, as the CLI's options are."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
