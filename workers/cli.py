"""``tokenmill worker --queue short|long [--concurrency N]``: a Celery worker, threads pool."""

from __future__ import annotations

import os

import click

from tokenmill import keys


@click.command()
@click.option("--queue", "-Q", type=click.Choice(keys.QUEUES), required=True, help="The queue to consume.")
@click.option(
    "--concurrency",
    "-c",
    type=click.IntRange(1, 4096),
    default=None,
    help="Threads (jobs in flight) in this worker; default 150 for short, 32 for long.",
)
@click.option(
    "--redis-url", envvar="TOKENMILL_REDIS_URL", default=None, help="Redis URL (broker and ledger)."
)
@click.option(
    "--server-url", envvar="TOKENMILL_SERVER_URL", default=None, help="SGLang server URL(s), comma-separated."
)
@click.option("--hostname", "-n", default=None, help="Celery node name (default <queue>-<pid>@<host>).")
@click.option("--loglevel", "-l", default="INFO", show_default=True)
@click.option(
    "--task-events/--no-task-events",
    default=None,
    help="Send Celery task events from the start (default: TOKENMILL_TASK_EVENTS, off; a running "
    "Flower turns them on by itself).",
)
def worker(
    queue: str,
    concurrency: int | None,
    redis_url: str | None,
    server_url: str | None,
    hostname: str | None,
    loglevel: str,
    task_events: bool | None,
) -> None:
    """Run a Celery worker on one queue (``celery -A tokenmill.app worker`` also works)."""
    from tokenmill import redis_conn
    from tokenmill.app import configure
    from tokenmill.errors import RedisUnavailableError
    from tokenmill.settings import Settings

    settings = Settings.load(redis_url=redis_url, server_url=server_url, task_events=task_events)
    try:  # a wrong password does not heal by waiting: say so once, now (Celery would retry forever)
        redis_conn.check_credentials(settings)
    except RedisUnavailableError as exc:
        raise click.ClickException(str(exc)) from None
    app = configure(settings)
    threads = concurrency or (150 if queue == "short" else 32)
    app.worker_main(
        [
            "worker",
            "-Q",
            queue,
            "-P",
            "threads",
            "-c",
            str(threads),
            "-l",
            loglevel,
            "-n",
            hostname or f"{queue}-{os.getpid()}@%h",
            "--without-gossip",
            "--without-mingle",
        ]
    )
