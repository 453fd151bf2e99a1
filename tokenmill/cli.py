"""The ``tokenmill`` command: a root that mounts each component's commands lazily.

Only this module knows every component; importing a component happens when its command runs,
so ``tokenmill --help`` stays fast.
"""

from __future__ import annotations

import sys

import click

from tokenmill.errors import TokenmillError
from tokenmill.lazy_group import LazyGroup

# command name -> ("module:attribute" of a click command or group, its summary in --help)
COMMANDS: dict[str, tuple[str, str]] = {
    "enqueue": ("producer.cli:enqueue", "Enqueue dataset files into a run."),
    "status": ("producer.cli:status", "Show a run's progress."),
    "export": ("producer.cli:export", "Write a run's completions as JSONL, one file per partition."),
    "resume": ("producer.cli:resume", "Lift a run's pause and republish every job of it that is not done."),
    "pause": ("producer.cli:pause", "Pause a run: nothing more is claimed, running jobs finish."),
    "runs": ("producer.ops_cli:runs", "List every run in this Redis, newest first."),
    "retry": ("producer.ops_cli:retry", "Send a run's failed (or cancelled) jobs back to the queue."),
    "cancel": ("producer.ops_cli:cancel", "Cancel a run's queued jobs (and with --now its running ones)."),
    "seal": (
        "producer.results_cli:seal",
        "Move done results out of Redis into Parquet shards of the result store.",
    ),
    "repair": ("producer.results_cli:repair", "Put the jobs of lost or corrupt shards back to queued."),
    "delete": ("producer.results_cli:delete", "Delete a run's keys (and, with --results, its shards)."),
    "worker": ("workers.cli:worker", "Run a Celery worker on the short or long queue."),
    "server": ("server_mgr.cli:server", "Launch, supervise and inspect SGLang (or sim) servers."),
    "flower": ("producer.flower:flower", "Start Flower on the tokenmill app."),
    "dashboard": (
        "producer.dashboard.cli:dashboard",
        "Serve a run's live page: progress, throughput, servers, failures, outputs.",
    ),
    "api": (
        "producer.api.cli:api",
        "Serve OpenAI's Batch API (/v1/files, /v1/batches, /v1/models) over tokenmill.",
    ),
    "metrics": ("producer.metrics:metrics", "Serve Prometheus metrics for runs and servers."),
    "demo": ("tokenmill.demo:demo", "Run the whole pipeline on this machine with the sim engine."),
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tokenmill")
def cli() -> None:
    """tokenmill: datasets of prompts in, datasets of completions out, exactly once."""


def main(argv: list[str] | None = None) -> None:
    """Console entry point: tokenmill errors print as one clear line and exit 2."""
    try:
        cli.main(args=argv, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except TokenmillError as exc:
        click.echo(f"tokenmill: error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
