"""``tokenmill server sim``: launch the sim with SGLang's flag names plus ``--sim-*`` knobs.

The flags SGLang also has keep SGLang's names and meaning, so the server manager builds one argv
for either engine. ``python -m server_mgr.sim`` runs the same command.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
import orjson

from server_mgr.sim.config import SimConfig


def _unit(_ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise click.BadParameter(f"must be in [0, 1], got {value}", param=param)
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=30000, show_default=True)
@click.option("--model-path", "--model", "model_path", default="sim-model", show_default=True)
@click.option("--served-model-name", default=None, help="Defaults to the model path.")
@click.option(
    "--max-total-tokens", type=int, default=200000, show_default=True, help="KV pool capacity in tokens."
)
@click.option("--context-length", type=int, default=None, help="Default: the model's own.")
@click.option("--max-running-requests", type=int, default=1024, show_default=True)
@click.option("--max-queued-requests", type=int, default=None, help="Default: unbounded.")
@click.option("--api-key", default=None)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Options in a file, as SGLang's --config; the sim reads its api-key (JSON, as tokenmill writes it).",
)
@click.option(
    "--reasoning-parser",
    default=None,
    help="Any name: outputs start with reasoning text (reasoning_content).",
)
@click.option(
    "--tool-call-parser",
    default=None,
    help="qwen25 (or qwen, hermes): tool calls are written as <tool_call> blocks and parsed.",
)
@click.option(
    "--constrained-json-disable-any-whitespace",
    is_flag=True,
    help="JSON outputs carry no whitespace between tokens (xgrammar's option).",
)
@click.option("--mem-fraction-static", type=float, default=0.88, show_default=True)
@click.option("--tp-size", "--tensor-parallel-size", "tp_size", type=int, default=1, show_default=True)
@click.option("--stream-interval", type=int, default=1, show_default=True)
@click.option("--decode-log-interval", type=int, default=40, show_default=True)
@click.option(
    "--load-snapshot-publish-interval",
    type=int,
    default=15,
    show_default=True,
    help="/v1/loads is refreshed every N decode steps (and at each prefill, and when idle).",
)
@click.option("--enable-metrics", is_flag=True)
@click.option("--allow-auto-truncate", is_flag=True)
@click.option("--log-level", default="info", show_default=True)
@click.option("--skip-server-warmup", is_flag=True)
@click.option(
    "--sim-startup-delay-s",
    "startup_delay_s",
    type=float,
    default=0.5,
    show_default=True,
    help="Loading time before the port is bound.",
)
@click.option(
    "--sim-warmup-s",
    "warmup_s",
    type=float,
    default=0.2,
    show_default=True,
    help="Bound but /health 503 for this long.",
)
@click.option(
    "--sim-health-latency-s",
    "health_latency_s",
    type=float,
    default=1.0,
    show_default=True,
    help="How long a healthy /health takes.",
)
@click.option(
    "--sim-health-timeout-s",
    "health_timeout_s",
    type=float,
    default=20.0,
    show_default=True,
    help="A stalled /health gives 503 after this long.",
)
@click.option(
    "--sim-drain-poll-s",
    "drain_poll_s",
    type=float,
    default=5.0,
    show_default=True,
    help="Period of the SIGTERM drain check.",
)
@click.option("--sim-step-ms", "step_ms", type=float, default=10.0, show_default=True)
@click.option("--sim-step-ms-per-req", "step_ms_per_req", type=float, default=0.05, show_default=True)
@click.option(
    "--sim-prefill-tokens-per-ms", "prefill_tokens_per_ms", type=float, default=200.0, show_default=True
)
@click.option("--sim-mean-output-tokens", "mean_output_tokens", type=int, default=200, show_default=True)
@click.option(
    "--sim-model-context-length",
    "model_context_length",
    type=int,
    default=32768,
    show_default=True,
    help="The model's own context length (its config.json), used without --context-length.",
)
@click.option(
    "--sim-crash-diagnostics-s",
    "crash_diagnostics_s",
    type=float,
    default=5.0,
    show_default=True,
    help="After a child process dies: how long /health hangs before the tree is killed.",
)
@click.option(
    "--sim-crash-after-requests",
    "crash_after_requests",
    type=int,
    default=None,
    help="Crash (SIGKILL) when the Nth chat request arrives.",
)
@click.option(
    "--sim-error-every",
    "error_every",
    type=int,
    default=None,
    help="Every Nth chat request ends with a 503 error chunk after a few tokens.",
)
@click.option(
    "--sim-stall-every",
    "stall_every",
    type=int,
    default=None,
    help="Every Nth chat request goes silent after a few tokens.",
)
@click.option(
    "--sim-oom-above",
    "oom_above",
    type=float,
    default=None,
    help="CUDA-graph OOM at startup when --mem-fraction-static is above this.",
)
@click.option(
    "--sim-oom-below",
    "oom_below",
    type=float,
    default=None,
    help="'Not enough memory' at startup when --mem-fraction-static is below this.",
)
@click.option(
    "--sim-perturb",
    "perturb",
    type=float,
    default=0.0,
    callback=_unit,
    show_default=True,
    help="Probability that an output token is swapped.",
)
@click.option(
    "--sim-refuse-continuations",
    "refuse_continuations",
    is_flag=True,
    help="Answer 400 to continue_final_message, as a server whose chat template cannot continue.",
)
@click.option("--sim-seed", "seed", type=int, default=0, show_default=True)
def sim(**options: object) -> None:
    """Run the SGLang-compatible simulator (no GPU) until SIGTERM or Ctrl-C."""
    from server_mgr.sim.lifecycle import run

    config_file = options.pop("config_file")
    if config_file and options["api_key"] is None:  # a flag on the command line wins, as in SGLang
        options["api_key"] = orjson.loads(Path(str(config_file)).read_bytes()).get("api-key")
    cfg = SimConfig(**options)  # type: ignore[arg-type]
    try:
        cfg.validate()
    except ValueError as exc:
        click.echo(f"ValueError: {exc}", err=True)
        sys.exit(1)
    sys.exit(run(cfg))
