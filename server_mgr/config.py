"""Server manager configuration: ``[[server]]`` tables in a TOML file, checked before anything starts.

Every key is typed by the dataclasses below; an unknown key, a wrong type or an invalid value is
a :class:`~tokenmill.errors.ConfigError` that names the file, the server and the key. A server
without ``port`` listens on SGLang's default, 30000; ``log_dir`` (default ``tokenmill-logs``) is
relative to the config file's folder, like every relative path a config file names.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import socket
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server_mgr import sglang_flags
from tokenmill.errors import ConfigError, LossyKvCacheError

ENGINES = ("sglang", "sim")
DEFAULT_LAUNCHER = ("python", "-m", "sglang.launch_server")
DEFAULT_PORT = 30000  # SGLang's own default
DEFAULT_LOG_DIR = "tokenmill-logs"  # beside the config file
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class SimKnobs:
    """The sim engine's own knobs (``[server.sim]``), passed as ``--sim-<key>``."""

    startup_delay_s: float | None = None
    warmup_s: float | None = None
    health_latency_s: float | None = None
    health_timeout_s: float | None = None
    drain_poll_s: float | None = None
    step_ms: float | None = None
    step_ms_per_req: float | None = None
    prefill_tokens_per_ms: float | None = None
    mean_output_tokens: int | None = None
    crash_after_requests: int | None = None
    error_every: int | None = None
    stall_every: int | None = None
    oom_above: float | None = None
    oom_below: float | None = None
    perturb: float | None = None
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """One ``[[server]]`` table. Units are in the names; ``source`` says where it was read."""

    name: str = ""
    port: int = DEFAULT_PORT
    engine: str = "sglang"
    host: str = "127.0.0.1"
    url: str = ""
    model_path: str = ""
    served_model_name: str | None = None
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    kv_cache_dtype: str = "auto"
    enable_hierarchical_cache: bool = False
    hicache_size: int | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None  # tool calls come back as tool_calls only with one
    enable_metrics: bool = False
    cuda_graphs: bool = True  # false: 0.5.23's --cuda-graph-backend-{decode,prefill} disabled
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    launcher: tuple[str, ...] = DEFAULT_LAUNCHER
    allow_lossy_kv_cache: bool = False
    max_restarts: int = 5
    restart_window_s: float = 600.0
    backoff_initial_s: float = 2.0
    backoff_max_s: float = 60.0
    mem_fraction_bounds: tuple[float, float] = (0.5, 0.95)
    mem_fraction_step: float = 0.02
    drain_grace_s: float = 120.0
    stop_grace_s: float = 30.0
    startup_timeout_s: float = 1800.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 25.0
    health_failures: int = 3
    log_dir: str = DEFAULT_LOG_DIR
    sim: SimKnobs = field(default_factory=SimKnobs)
    source: str = field(default="", compare=False)

    @property
    def probe_host(self) -> str:
        """The host the manager itself connects to (loopback when the server listens on all)."""
        return "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host

    @property
    def probe_url(self) -> str:
        return f"http://{_bracket(self.probe_host)}:{self.port}"

    @property
    def public_url(self) -> str:
        """The URL published for workers: ``url`` if set, else host:port (hostname for 0.0.0.0)."""
        if self.url:
            return self.url.rstrip("/")
        host = socket.gethostname() if self.host in WILDCARD_HOSTS else self.host
        return f"http://{_bracket(host)}:{self.port}"

    @property
    def log_path(self) -> Path:
        """The file the server's stdout and stderr are appended to."""
        return Path(self.log_dir) / f"{self.name}.log"

    @property
    def model_name(self) -> str:
        """The name clients send as ``model``."""
        return self.served_model_name or self.model_path or "default"


def load_config(path: str | Path, env: typing.Mapping[str, str] | None = None) -> list[ServerConfig]:
    """Every ``[[server]]`` of the TOML file at ``path``, validated; ConfigError names the problem."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the server config: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"server"})
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key {unknown[0]!r} (expected [[server]] tables)")
    tables = data.get("server")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{path}: expected one or more [[server]] tables")
    env = os.environ if env is None else env
    configs = [_server(t, f"{path}: [[server]] #{i + 1}", env, path.parent) for i, t in enumerate(tables)]
    _check_ports_given(configs, tables, path)
    _check_unique(configs, path)
    return configs


def _server(table: dict[str, Any], where: str, env: typing.Mapping[str, str], base: Path) -> ServerConfig:
    if isinstance(table.get("name"), str):
        where = f"{where} ({table['name']!r})"
    values = _typed(ServerConfig, table, where, nested=("sim",))
    sim = table.get("sim")
    if sim is not None:
        if not isinstance(sim, dict):
            raise _bad(where, "sim", "must be a table ([server.sim])")
        values["sim"] = SimKnobs(**_typed(SimKnobs, sim, where, prefix="sim."))
    if "name" not in table:
        raise _bad(where, "name", "is required")
    values["log_dir"] = str((base / Path(values.get("log_dir", DEFAULT_LOG_DIR)).expanduser()).resolve())
    config = ServerConfig(**values, source=where)
    config = _resolve_api_key(config, where, env)
    _validate(config, table, where)
    return config


def _typed(
    cls: type, table: dict[str, Any], where: str, *, nested: tuple[str, ...] = (), prefix: str = ""
) -> dict[str, Any]:
    """``table``'s values converted to ``cls``'s field types; unknown keys are refused.

    Keys in ``nested`` are sub-tables the caller reads itself.
    """
    hints = typing.get_type_hints(cls)
    allowed = {f.name for f in dataclasses.fields(cls)} - {"source", *nested}
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key in nested:
            continue
        if key not in allowed:
            raise _bad(where, prefix + key, f"unknown key (known: {', '.join(sorted(allowed))})")
        values[key] = _coerce(value, hints[key], where, prefix + key)
    return values


# scalar type -> (what the error says it must be, the check)
_SCALARS: dict[type, tuple[str, typing.Callable[[Any], bool]]] = {
    bool: ("true or false", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: (
        "a number",
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v),
    ),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _coerce(value: Any, hint: Any, where: str, key: str) -> Any:
    """``value`` checked against (and converted to) the type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _coerce(value, next(a for a in args if a is not type(None)), where, key)
    if hint in _SCALARS:
        what, ok = _SCALARS[hint]
        if not ok(value):
            raise _bad(where, key, f"must be {what}, got {value!r}")
        return float(value) if hint is float else value
    if origin is tuple:
        return _coerce_tuple(value, args, where, key)
    if origin is dict:
        return _coerce_env(value, where, key)
    raise AssertionError(f"unsupported config type {hint!r}")  # pragma: no cover


def _coerce_tuple(value: Any, args: tuple[Any, ...], where: str, key: str) -> tuple[Any, ...]:
    if isinstance(value, str) and args == (str, ...):
        return tuple(shlex.split(value))
    if not isinstance(value, list):
        raise _bad(where, key, f"must be a list, got {value!r}")
    if args[-1] is not Ellipsis and len(value) != len(args):
        raise _bad(where, key, f"must be a list of {len(args)} values, got {value!r}")
    item_types = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
    return tuple(_coerce(v, t, where, key) for v, t in zip(value, item_types, strict=True))


def _coerce_env(value: Any, where: str, key: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _bad(where, key, f'must be a table of NAME = "value", got {value!r}')
    out: dict[str, str] = {}
    for name, item in value.items():
        if not _ENV_RE.match(name):
            raise _bad(where, f"{key}.{name}", "is not a valid environment variable name")
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise _bad(where, f"{key}.{name}", f"must be a string or a number, got {item!r}")
        out[name] = str(item)
    return out


def _resolve_api_key(config: ServerConfig, where: str, env: typing.Mapping[str, str]) -> ServerConfig:
    if config.api_key is not None and config.api_key_env is not None:
        raise _bad(where, "api_key_env", "give api_key or api_key_env, not both")
    if config.api_key_env is None:
        return config
    key = env.get(config.api_key_env)
    if not key:
        raise _bad(where, "api_key_env", f"environment variable {config.api_key_env} is not set")
    return dataclasses.replace(config, api_key=key)


def _validate(c: ServerConfig, table: dict[str, Any], where: str) -> None:
    """Value checks, each naming its key."""
    for key, ok, problem in _rules(c):
        if not ok:
            raise _bad(where, key, f"{problem}, got {getattr(c, key, None)!r}")
    if c.kv_cache_dtype not in sglang_flags.LOSSLESS_KV_CACHE_DTYPES and not c.allow_lossy_kv_cache:
        raise LossyKvCacheError(
            f"{where}: key 'kv_cache_dtype': {c.kv_cache_dtype!r} quantizes the KV cache, which "
            "measurably degrades output quality (greedy outputs diverge from the bf16 reference); "
            "refused unless allow_lossy_kv_cache = true. Measure it first with "
            "`tokenmill server check-quality`"
        )
    _validate_fraction(c, where)
    flags_problem = sglang_flags.extra_args_problem(c.extra_args)
    if flags_problem:
        raise _bad(where, "extra_args", flags_problem)
    if c.engine != "sim" and "sim" in table:
        raise _bad(where, "sim", '[server.sim] is only for engine = "sim"')
    _validate_sim(c.sim, where)


def _positive(value: float | None) -> bool:
    return value is None or value > 0


def _rules(c: ServerConfig) -> list[tuple[str, bool, str]]:
    """(key, whether its value is valid, what it must be) for every single-key rule."""
    return [
        ("name", bool(_NAME_RE.match(c.name)), "must be 1-64 letters, digits, '.', '_' or '-'"),
        _one_of(c, "engine", ENGINES),
        ("port", 1 <= c.port <= 65535, "must be between 1 and 65535"),
        ("host", bool(c.host.strip()), "must not be empty"),
        ("model_path", c.engine == "sim" or bool(c.model_path), "is required for engine sglang"),
        (
            "served_model_name",
            c.served_model_name is None or (bool(c.served_model_name) and ":" not in c.served_model_name),
            "must be non-empty and may not contain ':' (SGLang refuses it: it reads 'a:b' as a LoRA adapter)",
        ),
        ("url", not c.url or c.url.startswith(("http://", "https://")), "must be an http(s) URL"),
        ("tp_size", c.tp_size >= 1, "must be at least 1"),
        ("dp_size", c.dp_size >= 1, "must be at least 1"),
        ("hicache_size", c.hicache_size is None or c.hicache_size >= 0, "must be >= 0 (GB)"),
        (
            "hicache_size",
            c.hicache_size is None or c.enable_hierarchical_cache,
            "needs enable_hierarchical_cache = true",
        ),
        ("context_length", _positive(c.context_length), "must be positive"),
        ("max_running_requests", _positive(c.max_running_requests), "must be positive"),
        _one_of(c, "reasoning_parser", sglang_flags.REASONING_PARSERS),
        _one_of(c, "tool_call_parser", sglang_flags.TOOL_CALL_PARSERS),
        ("launcher", bool(c.launcher), "must not be empty"),
        ("max_restarts", c.max_restarts >= 0, "must be >= 0"),
        ("restart_window_s", c.restart_window_s > 0, "must be positive"),
        ("backoff_initial_s", c.backoff_initial_s > 0, "must be positive"),
        ("backoff_max_s", c.backoff_max_s >= c.backoff_initial_s, "must be >= backoff_initial_s"),
        ("drain_grace_s", c.drain_grace_s >= 0, "must be >= 0"),
        ("stop_grace_s", c.stop_grace_s > 0, "must be positive"),
        ("startup_timeout_s", c.startup_timeout_s > 0, "must be positive"),
        ("health_interval_s", c.health_interval_s > 0, "must be positive"),
        ("health_timeout_s", c.health_timeout_s > 0, "must be positive"),
        ("health_failures", c.health_failures >= 1, "must be at least 1"),
        _one_of(c, "kv_cache_dtype", sglang_flags.KV_CACHE_DTYPES, " (sglang 0.5.23's choices)"),
    ]


def _one_of(
    c: ServerConfig, key: str, choices: typing.Sequence[str], note: str = ""
) -> tuple[str, bool, str]:
    """The rule that ``key``, when set, is one of ``choices``."""
    return key, getattr(c, key) in (None, *choices), f"must be one of {', '.join(choices)}{note}"


def _validate_fraction(c: ServerConfig, where: str) -> None:
    low, high = c.mem_fraction_bounds
    if not 0 < low < high < 1:
        raise _bad(
            where,
            "mem_fraction_bounds",
            f"must be [low, high] with 0 < low < high < 1, got {list(c.mem_fraction_bounds)}",
        )
    if not 0 < c.mem_fraction_step < high - low:
        raise _bad(
            where, "mem_fraction_step", f"must be positive and below high - low, got {c.mem_fraction_step}"
        )
    fraction = c.mem_fraction_static
    if fraction is not None and not low <= fraction <= high:
        raise _bad(
            where, "mem_fraction_static", f"must lie within mem_fraction_bounds {[low, high]}, got {fraction}"
        )


def _validate_sim(sim: SimKnobs, where: str) -> None:
    for f in dataclasses.fields(sim):
        value = getattr(sim, f.name)
        fraction = f.name in ("perturb", "oom_above", "oom_below")
        if value is not None and not (0 <= value <= 1 if fraction else value >= 0):
            limit = "within [0, 1]" if fraction else ">= 0"
            raise _bad(where, f"sim.{f.name}", f"must be {limit}, got {value!r}")


def _check_ports_given(configs: list[ServerConfig], tables: list[dict[str, Any]], path: Path) -> None:
    """Servers of one config run on one host: two without a port would both take 30000."""
    unported = [c.name for c, t in zip(configs, tables, strict=True) if "port" not in t]
    if len(unported) > 1:
        names = ", ".join(repr(n) for n in unported)
        raise ConfigError(
            f"{path}: servers {names} have no 'port', so each would listen on the default "
            f"{DEFAULT_PORT} on this host: give each server its own port"
        )


def _check_unique(configs: list[ServerConfig], path: Path) -> None:
    for i, c in enumerate(configs):
        if any(e.name == c.name for e in configs[:i]):
            raise _bad(c.source, "name", f"{c.name!r} is used by two servers in {path}")
        if any((e.host, e.port) == (c.host, c.port) for e in configs[:i]):
            raise _bad(c.source, "port", f"{c.host}:{c.port} is used by two servers in {path}")


def _bad(where: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{where}: key {key!r}: {problem}")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
