"""``tokenmill server``: up, status, stop, command, check-quality, and the sim engine.

``sim`` is mounted lazily, so ``tokenmill server --help`` works without importing it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import click

from server_mgr.command import display_command
from server_mgr.config import ServerConfig, load_config
from tokenmill import servers
from tokenmill.lazy_group import LazyGroup
from tokenmill.settings import Settings
from tokenmill.url_secrets import redact_url

LAZY = {"sim": ("server_mgr.sim.cli:sim", "Run the SGLang-compatible simulator (no GPU).")}
STALE_AFTER_S = 30.0
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
COLUMNS = "NAME,ENGINE,STATE,URL,PID,RESTARTS,KV TOKENS,CONTEXT,RUNNING,QUEUED,USAGE,LAST ERROR".split(",")

_config_option = click.option(
    "--config",
    "config_path",
    type=_FILE,
    help="TOML file with one or more [[server]] tables.",
)
_redis_option = click.option("--redis-url", default=None, help="Redis URL [env TOKENMILL_REDIS_URL].")


@click.group(cls=LazyGroup, lazy=LAZY, context_settings={"help_option_names": ["-h", "--help"]})
def server() -> None:
    """Launch, supervise and inspect SGLang (or sim) servers."""


@server.command()
@_config_option
@_redis_option
@click.option(
    "--no-pause-consumers", is_flag=True, help="Do not pause the workers' consumers while no server is ready."
)
def up(config_path: Path | None, redis_url: str | None, no_pause_consumers: bool) -> None:
    """Launch and supervise the servers of --config.

    Runs until SIGTERM/SIGINT (drain, then stop) or `tokenmill server stop`.
    """
    from server_mgr.consumers import ConsumerGate, celery_control
    from server_mgr.manager import serve, setup_logging
    from tokenmill import redis_conn

    configs = load_config(_required(config_path))
    settings = Settings.load(redis_url=redis_url)
    setup_logging(Path(configs[0].log_dir))
    client = redis_conn.connect(settings)
    redis_conn.warn_durability(client)
    gate = None if no_pause_consumers else ConsumerGate(client, celery_control(settings))
    sys.exit(serve(configs, client, gate, settings))


@server.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_redis_option
def status(as_json: bool, redis_url: str | None) -> None:
    """Show every published server (read from Redis: works from any host)."""
    from server_mgr.consumers import paused_reason
    from tokenmill import quick_redis

    client = quick_redis.connect(Settings.load(redis_url=redis_url), name="tokenmill-server-status")
    rows = [_status_row(r) for r in servers.load_all(client)]
    paused = paused_reason(client)
    if as_json:
        click.echo(json.dumps({"servers": rows, "consumers_paused": paused}, indent=2))
        return
    _print_table(rows)
    if paused:
        click.echo(f"\nconsumers paused: {paused}")


@server.command()
@_config_option
@click.option("--name", "names", multiple=True, help="A server name (repeatable).")
@click.option("--all", "stop_all", is_flag=True, help="Every published server.")
@click.option("--now", is_flag=True, help="Do not wait for in-flight requests.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=None,
    help="Seconds to wait for the servers to be down [drain_grace_s + stop_grace_s + 60].",
)
@click.option("--no-wait", is_flag=True, help="Leave the stop request and return.")
@_redis_option
def stop(
    config_path: Path | None,
    names: tuple[str, ...],
    stop_all: bool,
    now: bool,
    timeout_s: float | None,
    no_wait: bool,
    redis_url: str | None,
) -> None:
    """Drain and stop servers (from any host).

    Leaves a stop request in Redis that each server's supervisor obeys, then waits for `down`.
    """
    from server_mgr.reporting import stop_servers
    from tokenmill import redis_conn

    configs = load_config(config_path) if config_path else []
    client = redis_conn.connect(Settings.load(redis_url=redis_url))
    wanted = [c.name for c in configs] + list(names)
    if stop_all:
        wanted += [r.name for r in servers.load_all(client)]
    if not wanted:
        raise click.UsageError("give --config, --name or --all")
    if timeout_s is None:
        timeout_s = max([c.drain_grace_s + c.stop_grace_s for c in configs] or [600.0]) + 60
    timeout_s = None if no_wait else timeout_s
    ok = stop_servers(client, list(dict.fromkeys(wanted)), not now, timeout_s, STALE_AFTER_S)
    sys.exit(0 if ok else 1)


@server.command()
@_config_option
@click.option("--show-secrets", is_flag=True, help="Print the API key instead of ***.")
def command(config_path: Path | None, show_secrets: bool) -> None:
    """Print each server's exact launch command (one line each)."""
    for config in load_config(_required(config_path)):
        click.echo(display_command(config, show_secrets=show_secrets))


@server.command("check-quality")
@click.option("--reference", type=_FILE, help="Config of the reference server (launched, then stopped).")
@click.option("--candidate", type=_FILE, help="Config of the candidate server (launched, then stopped).")
@click.option("--reference-url", help="A running reference server instead of --reference.")
@click.option("--candidate-url", help="A running candidate server instead of --candidate.")
@click.option("--prompts", type=_FILE, required=True, help="JSONL with 'prompt' or 'messages' per line.")
@click.option(
    "--threshold",
    type=click.FloatRange(0, 1),
    default=0.95,
    show_default=True,
    help="Minimum mean shared-prefix fraction to pass.",
)
@click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Requests at a time (1 keeps batches, hence greedy outputs, reproducible).",
)
@click.option("--api-key", default=None, help="For --*-url servers [env TOKENMILL_API_KEY].")
@click.option("--model", default=None, help="Model name for --*-url servers [env TOKENMILL_MODEL].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check_quality(
    reference: Path | None,
    candidate: Path | None,
    reference_url: str | None,
    candidate_url: str | None,
    prompts: Path,
    threshold: float,
    max_tokens: int,
    seed: int,
    concurrency: int,
    api_key: str | None,
    model: str | None,
    as_json: bool,
) -> None:
    """Compare a candidate config's greedy outputs with a reference's.

    Exit code 0 when the mean shared-prefix fraction reaches --threshold, 1 when it does not.
    """
    from server_mgr import quality

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    settings = Settings.load(api_key=api_key, model=model)
    reference_side = _side("reference", reference, reference_url, settings)
    candidate_side = _side("candidate", candidate, candidate_url, settings)
    result = quality.run_check(
        reference_side,
        candidate_side,
        quality.load_prompts(prompts),
        threshold=threshold,
        max_tokens=max_tokens,
        seed=seed,
        concurrency=concurrency,
    )
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        _print_quality(result, [reference_side, candidate_side])
    sys.exit(0 if result.passed else 1)


# --- helpers -------------------------------------------------------------------------------------


def _required(config_path: Path | None) -> Path:
    if config_path is None:
        raise click.UsageError("--config is required")
    return config_path


def _side(label: str, path: Path | None, url: str | None, settings: Settings) -> Any:
    from server_mgr.quality import Side

    if url is not None and path is None:
        return Side(label, url=url, api_key=settings.api_key, model=settings.model)
    if path is None or url is not None:
        raise click.UsageError(f"give exactly one of --{label} and --{label}-url")
    config: ServerConfig = load_config(path)[0]
    return Side(label, config=config, api_key=config.api_key, model=config.model_name)


def _status_row(record: servers.ServerRecord) -> dict[str, Any]:
    row = dataclasses.asdict(record)
    active = record.state not in (servers.DOWN, servers.FAILED)
    row["stale"] = active and not record.is_fresh(STALE_AFTER_S)
    return row


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        click.echo("no servers published")
        return
    table = [COLUMNS] + [_table_row(r) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
    for row in table:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        click.echo("  ".join([*cells, row[-1]]).rstrip())


def _table_row(row: dict[str, Any]) -> list[str]:
    live = row["live"]
    age = time.time() - row["updated_at"]
    state = row["state"] + (f" (stale {age:.0f}s)" if row["stale"] else "")
    figures = [row[k] for k in ("pid", "restarts", "max_total_num_tokens", "context_length")]
    figures += [live.get(k) for k in ("running_req", "queue_req", "token_usage")]
    return [row["name"], row["engine"], state, row["url"], *map(_cell, figures), row["last_error"][:80]]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _print_quality(result: Any, sides: list[Any]) -> None:
    for side in sides:
        where = redact_url(side.url) if side.url else f"{side.config.source} -> {side.config.probe_url}"
        click.echo(f"{side.label}: {where}")
    n = result.prompts
    click.echo(f"prompts: {n} (greedy: temperature 0, fixed seed)")
    click.echo(f"exact match:             {n - result.diverged}/{n} ({result.exact_match_rate:.1%})")
    click.echo(f"mean shared prefix:      {result.mean_prefix_fraction:.3f}")
    if result.median_first_divergence_words is not None:
        click.echo(
            f"median first divergence: word {result.median_first_divergence_words:g} "
            f"(over the {result.diverged} outputs that differ)"
        )
    verdict = "PASS" if result.passed else "FAIL"
    op = ">=" if result.passed else "<"
    click.echo(
        f"{verdict}: mean shared prefix {result.mean_prefix_fraction:.3f} {op} threshold {result.threshold:g}"
    )
