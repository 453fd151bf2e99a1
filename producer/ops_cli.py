"""Day-two commands: ``runs``, ``retry``, ``cancel`` (the producer's other commands are in
:mod:`producer.cli`)."""

from __future__ import annotations

import click
import orjson

from producer.cli import _connect, _connect_read, max_queued_option, redis_option, run_option

json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
partition_option = click.option("--partition", default=None, help="Only this partition of the run.")


@click.command()
@json_option
@redis_option
def runs(as_json: bool, redis_url: str | None) -> None:
    """List every run in this Redis: counts, tokens, first enqueue and last activity; newest first."""
    from producer.runs import list_runs, render_runs

    _, client = _connect_read(redis_url, "runs")
    docs = list_runs(client)
    if as_json:
        click.echo(orjson.dumps({"runs": docs}).decode())
        return
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # a pipe or a log: one line per run, never wrapped
        console = Console(width=200)
    console.print(render_runs(docs))


@click.command()
@run_option
@click.option(
    "--class",
    "classes",
    multiple=True,
    help="Only failed jobs of this error class (repeatable), e.g. context_length.",
)
@partition_option
@click.option("--cancelled", is_flag=True, help="Retry cancelled jobs instead of failed ones.")
@max_queued_option
@json_option
@redis_option
def retry(
    run: str,
    classes: tuple[str, ...],
    partition: str | None,
    cancelled: bool,
    max_queued: int | None,
    as_json: bool,
    redis_url: str | None,
) -> None:
    """Send RUN's failed jobs (or cancelled ones) back to queued, with a fresh retry budget."""
    from producer.retry import retry_run

    settings, client = _connect(redis_url, "retry")
    summary = retry_run(
        client,
        run,
        max_queued or settings.max_queued,
        classes=tuple(dict.fromkeys(classes)),
        partition=partition,
        cancelled=cancelled,
    )
    click.echo(orjson.dumps(summary.to_json()).decode() if as_json else summary.line())


@click.command()
@run_option
@partition_option
@click.option("--now", is_flag=True, help="Also stop running jobs within seconds (checkpoints are kept).")
@json_option
@redis_option
def cancel(run: str, partition: str | None, now: bool, as_json: bool, redis_url: str | None) -> None:
    """Cancel RUN's queued jobs; running ones finish, or stop at once with --now."""
    from producer.cancel import cancel_run

    _, client = _connect(redis_url, "cancel")
    summary = cancel_run(client, run, partition, now)
    click.echo(orjson.dumps(summary.to_json()).decode() if as_json else summary.line())
