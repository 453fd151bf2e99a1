"""Producer commands: ``enqueue``, ``status``, ``export``, ``resume`` (``seal``, ``repair`` and
``delete`` are in ``producer/results_cli.py``)."""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import click
import orjson

from tokenmill import keys

if TYPE_CHECKING:
    import redis

    from tokenmill.quick_redis import ReadClient
    from tokenmill.settings import Settings


def _connect(redis_url: str | None, name: str) -> tuple[Settings, redis.Redis]:
    """Settings and a checked Redis client named ``tokenmill-<name>`` in CLIENT LIST."""
    from tokenmill import redis_conn
    from tokenmill.settings import Settings

    settings = Settings.load(redis_url=redis_url)
    return settings, redis_conn.connect(settings, name=f"tokenmill-{name}")


def _connect_read(redis_url: str | None, name: str) -> tuple[Settings, ReadClient]:
    """As :func:`_connect`, for a command that only reads: a client that starts without
    importing redis-py (:mod:`tokenmill.quick_redis`), so the command starts fast."""
    from tokenmill import quick_redis
    from tokenmill.settings import Settings

    settings = Settings.load(redis_url=redis_url)
    return settings, quick_redis.connect(settings, name=f"tokenmill-{name}")


def _check_run(client: redis.Redis | ReadClient, run: str, hint: str = "") -> None:
    keys.check_run(run)
    if not client.sismember(keys.runs(), run):
        raise click.ClickException(f"no run named {run!r} in this Redis{hint}")


redis_option = click.option(
    "--redis-url",
    envvar="TOKENMILL_REDIS_URL",
    default=None,
    help="Redis URL (default redis://127.0.0.1:6379/0).",
)
run_option = click.option("--run", "run", required=True, help="The run's name.")
run_store_option = click.option(
    "--results-url",
    default=None,
    help="Where the run's shards are, if they moved (default: the store the ledger recorded).",
)
max_queued_option = click.option(
    "--max-queued",
    type=click.IntRange(min=1),
    default=None,
    help="At most N messages per queue in the broker; the rest wait in the ledger (default: settings).",
)


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=True))
@run_option
@click.option("--partition", default=None, help="Partition name (default: each file's stem).")
@click.option("--model", envvar="TOKENMILL_MODEL", default=None, help="Model name sent to the server.")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most N rows per partition.")
@click.option("--short-max-tokens", type=click.IntRange(min=1), default=10240, show_default=True)
@click.option("--long-max-tokens", type=click.IntRange(min=1), default=16384, show_default=True)
@click.option(
    "--long-prompt-tokens",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Prompts estimated above this many tokens go to the long queue.",
)
@click.option("--temperature", type=click.FloatRange(min=0), default=None)
@click.option("--top-p", type=click.FloatRange(min=0, min_open=True, max=1), default=None)
@click.option("--seed", type=int, default=None)
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="NAME=JSON",
    help="A request option for every row (repeatable), e.g. --param 'top_k=20'; a row's own value wins.",
)
@click.option(
    "--params",
    "params_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A JSON object of request options for every row (--param and the flags win over it).",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=None,
    help="N jobs per distinct prompt (ids <id>#<k>), each with a seed derived from --seed and k.",
)
@click.option("--skip-invalid", is_flag=True, help="Skip and count invalid rows instead of stopping.")
@click.option(
    "--quality-stop",
    "quality_stop",
    multiple=True,
    metavar="EXPR",
    help="Pause the run when a quality rate crosses a bound (repeatable): NAME>VALUE or NAME<VALUE, "
    "optionally @N, the judged jobs before it may trip, e.g. 'repetition>0.05@200' "
    "(default: TOKENMILL_QUALITY_STOP).",
)
@click.option(
    "--quality-reference",
    "quality_reference",
    metavar="URL",
    default=None,
    help="A reference server (SGLang) a sample of the run's jobs is scored on: a drift figure per "
    "partition, and 'drift' stop rules (default: TOKENMILL_QUALITY_REFERENCE_URL).",
)
@click.option(
    "--quality-sample",
    "quality_sample",
    type=float,
    default=None,
    metavar="FRACTION",
    help="The share of jobs scored on the reference, and always TOKENMILL_QUALITY_SAMPLE_MIN a "
    "partition (default: TOKENMILL_QUALITY_SAMPLE, 0.02).",
)
@max_queued_option
@redis_option
def enqueue(
    files: tuple[str, ...],
    run: str,
    partition: str | None,
    model: str | None,
    limit: int | None,
    short_max_tokens: int,
    long_max_tokens: int,
    long_prompt_tokens: int,
    temperature: float | None,
    top_p: float | None,
    seed: int | None,
    params: tuple[str, ...],
    params_file: str | None,
    samples: int | None,
    skip_invalid: bool,
    quality_stop: tuple[str, ...],
    quality_reference: str | None,
    quality_sample: float | None,
    max_queued: int | None,
    redis_url: str | None,
) -> None:
    """Enqueue dataset FILES (JSONL, Parquet, or a Hugging Face datasets directory) into a run."""
    from producer.enqueue import Enqueuer, Routing
    from producer.limits import check_max_tokens, for_servers
    from producer.options import run_params
    from producer.pause import encode_rules, store_rules
    from tokenmill import quality_drift as qd
    from tokenmill import redis_conn
    from tokenmill.ledger import Ledger

    keys.check_run(run)
    rules = encode_rules(quality_stop)
    settings, client = _connect(redis_url, "enqueue")
    default_rules = encode_rules(settings.quality_stop_rules)
    reference = qd.chosen(settings, quality_reference, quality_sample)
    limits = for_servers(client, settings)
    check_max_tokens("--short-max-tokens", "max_tokens", short_max_tokens, limits)
    check_max_tokens("--long-max-tokens", "max_tokens", long_max_tokens, limits)
    flags = {"temperature": temperature, "top_p": top_p, "seed": seed}
    options = run_params(params_file, params, flags, limits)
    if samples and samples > 1 and options.get("temperature") == 0:
        click.echo(
            "warning: --samples with --temperature 0 (greedy decoding): the samples of a prompt "
            "will all be the same text",
            err=True,
        )
    redis_conn.warn_durability(client, echo=lambda m: click.echo(m, err=True))
    store_rules(client, run, rules, default_rules)
    qd.store(client, run, reference)
    routing = Routing(
        model=model or settings.model,
        short_max_tokens=short_max_tokens,
        long_max_tokens=long_max_tokens,
        long_prompt_tokens=long_prompt_tokens,
        params=options,
        limits=limits,
    )
    enq = Enqueuer(
        Ledger(client, run),
        routing,
        max_queued or settings.max_queued,
        skip_invalid=skip_invalid,
        limit=limit,
        samples=samples,
        on_invalid=lambda e: click.echo(f"skipped: {e}", err=True),
    )
    progress = None
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        progress = Progress(
            SpinnerColumn(),
            TextColumn("enqueued"),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        task = progress.add_task("enqueue", total=None)
        enq.on_progress = lambda n: progress.advance(task, n)
    try:
        with nullcontext() if progress is None else progress:
            for path in files:
                enq.enqueue_file(path, partition)
    finally:
        click.echo(enq.summary.line(run))
    for conflict in enq.summary.conflicts[:20]:
        click.echo(f"error: {conflict}", err=True)
    if enq.summary.conflicts:
        raise SystemExit(1)


@click.command()
@run_option
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
@click.option("--watch", is_flag=True, help="Refresh a live view until interrupted.")
@click.option("--interval", type=float, default=2.0, show_default=True, help="Seconds between refreshes.")
@redis_option
def status(run: str, as_json: bool, watch: bool, interval: float, redis_url: str | None) -> None:
    """Show a run's progress: per partition, throughput, ETA, failures, servers."""
    from producer.status import run_status

    settings, client = _connect_read(redis_url, "status")
    _check_run(client, run, " (enqueue into it first)")
    urls = settings.server_urls
    if not as_json:
        from rich.console import Console
        from rich.live import Live

        from producer.status_view import render

        console = Console()
        if watch and console.is_terminal:
            with Live(render(run_status(client, run, urls)), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(interval)
                    live.update(render(run_status(client, run, urls)))
    while True:  # once; or, watching as JSON or in a log or a pipe, one frame per refresh, appended
        doc = run_status(client, run, urls)
        if as_json:
            click.echo(orjson.dumps(doc).decode())
        else:
            console.print(render(doc))
        if not watch:
            return
        time.sleep(interval)


@click.command()
@run_option
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--include-truncated", is_flag=True, help="Also export jobs that finished on max_tokens.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(("jsonl", "parquet", "openai-batch")),
    default="jsonl",
    show_default=True,
    help="OUT/<partition>.jsonl, a typed OUT/<partition>.parquet, or OpenAI Batch output lines "
    "(OUT/<partition>.jsonl, failed and cancelled jobs included).",
)
@run_store_option
@redis_option
def export(
    run: str, out_dir: str, include_truncated: bool, fmt: str, results_url: str | None, redis_url: str | None
) -> None:
    """Write every done job as OUT/<partition>.jsonl (training-ready rows), from Redis and from
    the run's sealed shards."""
    from producer.export import export_run
    from producer.export_rows import run_store
    from tokenmill.ledger import Ledger

    _, client = _connect(redis_url, "export")
    _check_run(client, run)
    ledger = Ledger(client, run)
    summary = export_run(ledger, out_dir, include_truncated, fmt, run_store(ledger, results_url))
    for path, n in summary.files.items():
        click.echo(f"{path}: {n} rows")
    if summary.from_shards:
        click.echo(f"{summary.from_shards} rows read from sealed shards, {summary.from_redis} from Redis")
    notes = []
    if summary.not_done:
        notes.append(f"{summary.not_done} jobs not done yet (not exported)")
    if summary.failed:
        notes.append(f"{summary.failed} failed (written with their error)")
    if summary.cancelled:
        written = "written as batch_cancelled" if fmt == "openai-batch" else "not exported"
        notes.append(f"{summary.cancelled} cancelled ({written})")
    if summary.skipped_truncated:
        notes.append(
            f"{summary.skipped_truncated} truncated (finish_reason length) left out; "
            "--include-truncated to include them"
        )
    if notes:
        click.echo("; ".join(notes))


@click.command()
@run_option
@max_queued_option
@redis_option
def resume(run: str, max_queued: int | None, redis_url: str | None) -> None:
    """Lift RUN's pause, if any (its quality rules count again from now), and republish every
    job of it that is not done (duplicates are harmless)."""
    from producer.resume import resume_run

    settings, client = _connect(redis_url, "resume")
    _check_run(client, run)
    click.echo(resume_run(client, run, max_queued or settings.max_queued).line(run))


@click.command()
@run_option
@click.option("--reason", default=None, help="Why (shown by status, the dashboard and the metrics).")
@redis_option
def pause(run: str, reason: str | None, redis_url: str | None) -> None:
    """Pause RUN: nothing more is claimed, running jobs finish, nothing is lost; `tokenmill
    resume` lifts it."""
    from producer.pause import pause_run
    from producer.scope import existing_run

    _, client = _connect(redis_url, "pause")
    now, held = pause_run(existing_run(client, run), reason)
    said = "paused" if now else f"already paused by {held.get('by', '?')}"
    click.echo(f"run {run}: {said}: {held.get('reason', '')}; running jobs finish, nothing more is claimed "
               f"until `tokenmill resume --run {run}`")  # fmt: skip
