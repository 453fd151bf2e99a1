"""The launch command of a server: its argv, its environment, and a printable (redacted) form.

The API key is not put on the command line, where ``ps`` shows it to every user of the machine:
SGLang reads it from a file of options (``--config FILE``, YAML; tokenmill writes JSON, which
YAML reads) that only its owner may read, written at each launch (:func:`write_key_file`).
SGLang 0.5.23 reads no environment variable for it, and takes one ``--config``: a server whose
``extra_args`` give their own gets the key as ``--api-key`` (docs/gpu-server.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from pathlib import Path

import orjson

from server_mgr.config import ServerConfig

REDACTED = "***"
_SECRET_ENV_RE = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)

# SGLang flags the sim engine does not model; they are left out of a sim's command.
SIM_UNSUPPORTED = frozenset(
    "--dp-size --kv-cache-dtype --enable-hierarchical-cache --hicache-size "
    "--cuda-graph-backend-decode --cuda-graph-backend-prefill".split()
)


def launch_argv(config: ServerConfig, *, redact: bool = False, key_file: Path | None = None) -> list[str]:
    """The exact argv that starts ``config``'s server: the SGLang flags in a fixed order (a sim's
    without those it does not model), then ``extra_args`` (then a sim's knobs). The API key goes
    as ``--config key_file`` when given, else as ``--api-key`` (``***`` when ``redact``)."""
    c = config
    key = (REDACTED if redact else c.api_key) if c.api_key else None
    pairs: list[tuple[str, object]] = [
        ("--model-path", c.model_path or None),
        ("--served-model-name", c.served_model_name),
        ("--host", c.host),
        ("--port", c.port),
        ("--tp-size", c.tp_size),
        ("--dp-size", c.dp_size if c.dp_size != 1 else None),
        ("--mem-fraction-static", c.mem_fraction_static),
        ("--kv-cache-dtype", c.kv_cache_dtype if c.kv_cache_dtype != "auto" else None),
        ("--enable-hierarchical-cache", c.enable_hierarchical_cache),
        ("--hicache-size", c.hicache_size),
        ("--context-length", c.context_length),
        ("--max-running-requests", c.max_running_requests),
        ("--reasoning-parser", c.reasoning_parser),
        ("--tool-call-parser", c.tool_call_parser),
        ("--enable-metrics", c.enable_metrics),
        # SGLang 0.5.23 deprecates --disable-cuda-graph in favour of these two
        ("--cuda-graph-backend-decode", None if c.cuda_graphs else "disabled"),
        ("--cuda-graph-backend-prefill", None if c.cuda_graphs else "disabled"),
        ("--config", key_file) if key and key_file else ("--api-key", key),
    ]
    skip = SIM_UNSUPPORTED if c.engine == "sim" else frozenset()
    argv: list[str] = []
    for flag, value in pairs:
        if value is None or value is False or flag in skip:
            continue
        argv.extend([flag] if value is True else [flag, _text(value)])
    if c.engine != "sim":
        return [*c.launcher, *argv, *c.extra_args]
    argv = [sys.executable, "-m", "server_mgr.sim", *argv, *c.extra_args]
    for f in dataclasses.fields(c.sim):  # ``--sim-<knob> value`` for every knob set in [server.sim]
        value = getattr(c.sim, f.name)
        if value is not None:
            argv.extend([f"--sim-{f.name.replace('_', '-')}", _text(value)])
    return argv


def write_key_file(config: ServerConfig) -> Path | None:
    """Write the API key where the server reads it from (beside its log, mode 0600) and return
    that path; None when the key goes on the command line: there is none, or ``extra_args`` hold
    the one ``--config`` SGLang takes."""
    if not config.api_key or "--config" in config.extra_args:
        return None
    path = config.log_path.with_name(f".{config.name}.api-key.yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an older launch keeps its mode otherwise
    with os.fdopen(fd, "wb") as fh:
        fh.write(orjson.dumps({"api-key": config.api_key}))
    return path


def display_command(config: ServerConfig, *, show_secrets: bool = False, key_file: Path | None = None) -> str:
    """The launch command as one shell line: ``ENV=value ... argv`` (secrets as ``***``)."""
    env = [
        f"{k}={v if show_secrets or not _SECRET_ENV_RE.search(k) else REDACTED}"
        for k, v in config.env.items()
    ]
    return shlex.join([*env, *launch_argv(config, redact=not show_secrets, key_file=key_file)])


def _text(value: object) -> str:
    if isinstance(value, float):
        return repr(round(value, 6))
    return str(value)
