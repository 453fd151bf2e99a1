"""``tokenmill flower``: Flower on the tokenmill Celery app, on loopback unless told otherwise.

Flower runs in this process (``app.start(["flower", ...])``), so basic-auth credentials given
through the environment never appear on a command line. Binding beyond loopback without auth is
refused: Flower's API can revoke tasks and shut workers down.
"""

from __future__ import annotations

import click

from producer import web_access

DEFAULT_PORT = 5555
DEFAULT_MAX_TASKS = 10_000
# Flower's tasks page columns: the args column shows ``['run', 'partition', 'job-id']``.
TASK_COLUMNS = "name,args,state,received,started,runtime,worker,retries"
AUTH_ENVVARS = ("TOKENMILL_FLOWER_BASIC_AUTH", "FLOWER_BASIC_AUTH")


@click.command()
@web_access.bind_options(DEFAULT_PORT, "basic auth")
@click.option(
    "--basic-auth",
    envvar=list(AUTH_ENVVARS),
    show_envvar=True,
    default=None,
    metavar="USER:PASSWORD[,...]",
    help="HTTP basic auth for the UI and API (prefer the environment variable to the flag).",
)
@click.option(
    "--max-tasks",
    type=click.IntRange(100),
    default=DEFAULT_MAX_TASKS,
    show_default=True,
    help="Tasks Flower keeps in memory (oldest are dropped).",
)
@click.option("--url-prefix", default=None, help="Serve under this path (behind a reverse proxy).")
@click.option(
    "--redis-url", envvar="TOKENMILL_REDIS_URL", default=None, help="Redis URL (the Celery broker)."
)
def flower(
    port: int,
    address: str,
    basic_auth: str | None,
    max_tasks: int,
    url_prefix: str | None,
    redis_url: str | None,
) -> None:
    """Start Flower on the tokenmill app (task events on, state in memory only)."""
    from tokenmill.app import configure
    from tokenmill.settings import Settings

    credentials = web_access.parse_basic_auth(basic_auth, f"--basic-auth or {AUTH_ENVVARS[0]}")
    how = f"{AUTH_ENVVARS[0]}=user:password (or --basic-auth)"
    web_access.check_exposure(address, credentials, "Flower", how)
    # in-memory state only, bounded, readable task columns
    argv = [
        "flower",
        f"--address={address}",
        f"--port={port}",
        "--persistent=False",
        f"--max_tasks={max_tasks}",
        f"--tasks_columns={TASK_COLUMNS}",
    ]
    if url_prefix:
        argv.append(f"--url_prefix={url_prefix}")
    if credentials:
        argv.append(f"--basic_auth={','.join(credentials)}")
    app = configure(Settings.load(redis_url=redis_url))
    # celery-types says start() does not return; Celery's returns the exit code its command raised
    code: int | None = app.start(argv)
    if code:
        raise SystemExit(code)
