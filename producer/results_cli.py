"""Result store commands: ``seal``, ``repair``, ``delete``."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING

import click
from redis.exceptions import LockError, RedisError

from producer.cli import _check_run, _connect, redis_option, run_option, run_store_option
from tokenmill import keys
from tokenmill.errors import TokenmillError

if TYPE_CHECKING:
    import redis
    from redis.lock import Lock

    from producer.result_store import ResultStore
    from producer.sealing import Sealer
    from tokenmill.settings import Settings

results_url_option = click.option(
    "--results-url",
    default=None,
    help="The result store (a directory or an fsspec URL such as s3://bucket/prefix); default: "
    "TOKENMILL_RESULTS_URL, else ~/.local/share/tokenmill/results.",
)
LOCK_TTL_S = 30.0  # a sealer that died holding the lock delays the next one at most this long


def make_sealer(
    settings: Settings,
    client: redis.Redis,
    store: ResultStore,
    crash_at: str | None = None,
    on_shard: Callable[[], None] | None = None,
    mark_chunk: int | None = None,
) -> Sealer:
    """A sealer; ``crash_at`` names a protocol step where the process kills itself (the chaos
    tests' fault hook)."""
    from producer.sealing import MARK_CHUNK, Sealer

    def fault(step: str) -> None:
        if step == crash_at:  # the chaos tests' hook: die here, as a crash would
            os.kill(os.getpid(), signal.SIGKILL)

    return Sealer(
        client,
        store,
        batch_jobs=settings.seal_batch_jobs,
        after_s=settings.seal_after_s,
        fault=fault,
        on_shard=on_shard,
        mark_chunk=mark_chunk or MARK_CHUNK,
    )


@click.command()
@click.option("--run", "runs", multiple=True, help="Seal only this run (repeatable; default: every run).")
@click.option("--once", is_flag=True, help="One pass, then exit.")
@click.option(
    "--all", "force", is_flag=True, help="Seal every done result now, whatever the batch size or age."
)
@click.option("--crash-at", type=click.Choice(("reserved", "specs_written", "tmp_written", "shard_written",
              "half_marked")), default=None, hidden=True)  # fmt: skip
@click.option("--mark-chunk", type=click.IntRange(min=1), default=None, hidden=True)
@results_url_option
@redis_option
def seal(
    runs: tuple[str, ...],
    once: bool,
    force: bool,
    crash_at: str | None,
    mark_chunk: int | None,
    results_url: str | None,
    redis_url: str | None,
) -> None:
    """Move done results out of Redis into Parquet shards of the result store.

    A partition is sealed once TOKENMILL_SEAL_BATCH_JOBS results are done, or its done results
    have waited TOKENMILL_SEAL_AFTER_S, or it has no job left to run. Several sealers may run:
    one works at a time (a Redis lock), and a crashed one's half-done shards are completed by
    the next pass. Runs until interrupted unless --once.
    """
    from producer.result_store import ResultStore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings, client = _connect(redis_url, "seal")
    for run in runs:
        _check_run(client, run)
    if results_url:
        settings = dataclasses.replace(settings, results_url=results_url)
    store = ResultStore(settings.results_location)
    lock = client.lock(keys.seal_lock(), timeout=LOCK_TTL_S)
    token = uuid.uuid4().hex  # this process's: a lock it held when Redis went away is its own
    sealer = make_sealer(settings, client, store, crash_at, lambda: _extend(lock), mark_chunk)
    click.echo(f"sealing into {store.shown}" + (f" (runs: {', '.join(runs)})" if runs else ""))
    while True:
        try:
            _pass(lock, token, sealer, list(runs) or None, force, once)
        except (RedisError, TokenmillError) as exc:
            if once:
                raise
            click.echo(f"seal pass failed, retrying in {settings.seal_check_s:g}s: {exc}", err=True)
        if once:
            return
        time.sleep(settings.seal_check_s)


def _pass(lock: Lock, token: str, sealer: Sealer, runs: list[str] | None, force: bool, once: bool) -> None:
    """One pass under the seal lock (waited for with ``once``, else skipped when taken)."""
    # A pass cut short by a Redis outage could not release the lock; the restarted Redis has it
    # back from its AOF, still ours: release it (compare-and-delete) rather than wait it out.
    # redis-py types Lock.lua_release as its class default, None; Lock() registers the script
    lock.lua_release(keys=[lock.name], args=[token], client=lock.redis)  # type: ignore[misc]
    if not lock.acquire(blocking=once, blocking_timeout=LOCK_TTL_S if once else None, token=token):
        if once:
            raise click.ClickException("another sealer held the seal lock for a minute; try again")
        return
    try:
        report = sealer.seal_runs(runs, force)
    finally:
        with suppress(LockError):  # it expired meanwhile: another sealer may hold it now
            lock.release()
    if report.shards or report.recovered or once:
        click.echo(
            f"sealed {report.jobs} result(s) into {report.shards} shard(s), {report.bytes:,} bytes"
            + (f"; completed {report.recovered} half-done seal(s)" if report.recovered else "")
        )
    for run, other in report.other_store.items() if once else ():
        click.echo(f"run {run}: not sealed, its shards are in {other} (use --results-url {other})")


def _extend(lock: Lock) -> None:
    with suppress(LockError):  # lost it: the protocol is safe beside another sealer, carry on
        lock.reacquire()


@click.command()
@run_option
@run_store_option
@redis_option
def repair(run: str, results_url: str | None, redis_url: str | None) -> None:
    """Put the jobs of lost or corrupt shards back to queued, so they are generated again."""
    from producer.export_rows import run_store
    from producer.repair import repair_run
    from tokenmill.ledger import Ledger

    settings, client = _connect(redis_url, "repair")
    _check_run(client, run)
    store = run_store(Ledger(client, run), results_url)
    sealer = make_sealer(settings, client, store) if store is not None else None
    summary = repair_run(client, run, store, sealer, settings.max_queued)
    click.echo("\n".join(summary.lines(run)))
    if summary.unrecoverable:
        raise SystemExit(1)


@click.command()
@run_option
@click.option("--results", is_flag=True, help="Also delete the run's shards from the result store.")
@click.option("--force", is_flag=True, help="Delete even while workers still hold the run's jobs.")
@run_store_option
@redis_option
def delete(run: str, results: bool, force: bool, results_url: str | None, redis_url: str | None) -> None:
    """Delete a run's keys from Redis (and, with --results, its shards)."""
    from producer.delete import delete_run
    from producer.result_store import ResultStore

    _, client = _connect(redis_url, "delete")
    _check_run(client, run)
    store = ResultStore(results_url) if results_url else None
    click.echo(delete_run(client, run, results=results, force=force, store=store).line(run, results))
