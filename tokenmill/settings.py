"""The one typed settings object, built at process start from flags and ``TOKENMILL_*`` variables.

Nothing in tokenmill reads the environment at import time; entry points call
:meth:`Settings.load` once and pass the object down.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from tokenmill import redis_url
from tokenmill.errors import ConfigError
from tokenmill.url_secrets import redact_url

ENV_PREFIX = "TOKENMILL_"
EVENT_LOOPS = ("uvloop", "asyncio")  # the worker's event loop (``event_loop``); the first is the default


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything configurable about a tokenmill process. Units are in the names."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    server_url: str = "http://127.0.0.1:30000"
    api_key: str | None = field(default=None, repr=False)
    model: str = "default"

    # leases, the reaper and retries
    lease_ttl_s: float = 30.0
    reaper_period_s: float = 5.0
    retry_backoff_s: float = 2.0
    retry_backoff_max_s: float = 300.0
    max_attempts: int = 8

    # per-request deadlines (the threads pool has no Celery time limits)
    connect_timeout_s: float = 10.0
    first_token_timeout_s: float = 3600.0
    stall_timeout_s: float = 120.0
    total_timeout_s: float = 6 * 3600.0

    # checkpoints and continuation
    checkpoint_every_tokens: int = 256
    checkpoint_every_s: float = 5.0
    continue_partial: bool = True
    think_end_tag: str = "</think>"  # closes the reasoning in a continued partial (see attempt.py)

    # admission and broker depth
    admission: bool = True
    admission_fraction: float = 0.9
    admission_queue_share: float = 0.75
    admission_default_output_tokens: int = 1024  # max_tokens assumed for a request without one
    admission_wait_s: float = 0.1
    # the closed loop: a window of requests per server, steered by what the server reports
    admission_closed_loop: bool = True
    admission_poll_s: float = 0.5  # how often one worker reads each server's /v1/loads
    admission_queue_target: int = 4  # requests to keep waiting on the server (or 10% of running)
    admission_usage_ceiling: float = 0.95  # the window grows only while KV use is below this
    admission_backoff: float = 0.75  # the window after a retraction, of what is on the server
    # the share of a request's projected growth (projected peak less its present use) the closed
    # loop sizes it by: 1 keeps room for every request's peak at once (no retraction by design,
    # and ~12% fewer requests running than SGLang's own scheduler keeps on a KV-bound server);
    # lower lets requests at different stages share the headroom, as SGLang's scheduler does
    # (it reserves 0.7 of what remains, decaying), and a rare retraction backs the window off
    admission_reserve: float = 0.6
    # the closed loop starts a window's requests spread over a request's lifetime, a few at a
    # time, so their peaks do not coincide (off: as soon as the window has room)
    admission_pacing: bool = True
    # paced, requests start in groups of this many: a group opens when all its starts are due,
    # and they go at once, so the server prefills them in one batch
    admission_pace_group: int = 2
    # a file to append the window rule's every input and decision to, one JSON line each
    # (workers/admission/policy.py; tests replay such a trace): empty, none
    admission_trace: str = ""
    # several servers: a job goes first to the server its prefix key prefers (rendezvous hashing,
    # workers/admission/affinity.py), the rest least full first; off: least full first
    server_affinity: bool = True
    # with affinity, how long a job whose sibling (same prefix key) this process admitted on a
    # server in the last minute waits for that server before it spills; 0: it spills at once
    server_affinity_wait_s: float = 0.0
    # with affinity, how long the siblings of a job (same prefix key) this process is sending
    # first wait for its first token, so that its prompt is in its server's cache before they
    # go there (workers/admission/affinity.py, Prefills); 0: they go at once
    server_prefill_wait_s: float = 10.0
    max_queued: int = 5000  # messages per queue in the broker; ~940 bytes each, the rest are ids

    # bounds at the door (producer/limits.py): a row or run option past one is refused at enqueue
    # with its file:line, so that no input can crash the producer or reach a server that it breaks
    input_max_row_bytes: int = 8 << 20  # a job as stored (its request and metadata as JSON)
    input_max_prompt_bytes: int = 4 << 20  # the prompt or messages as JSON: ~1M tokens at ~4 bytes each
    # levels of lists and objects in a row or option: real schemas use ~20; orjson writes 254 at
    # most, and jsonschema ran out of Python's stack at ~200
    input_max_depth: int = 64
    # response_format or tools as JSON: checking a 100 KB schema took 0.4 s, a 2.5 MB one 18.8 s
    input_max_schema_bytes: int = 128 << 10
    input_max_regex_chars: int = 64 << 10  # a regex or stop_regex
    # nested groups of a regex: re.compile overflowed at ~500, the sim's rstr at ~200
    input_max_regex_depth: int = 32
    # the most max_tokens (a row's, --short/--long-max-tokens) may be when no server of
    # TOKENMILL_SERVER_URL publishes its context length (a managed one does: then context - 1)
    input_max_tokens: int = 1 << 20
    server_wait_s: float = 1.0

    # worker shutdown
    shutdown_grace_s: float = 30.0

    # the worker's event loop, shared by all of a process's streams: uvloop (the default) or the
    # standard library's asyncio loop
    event_loop: str = EVENT_LOOPS[0]

    # monitoring: Celery task events (received/started/succeeded) cost a worker three Redis
    # publishes and their encoding per job; only Flower and other event consumers read them.
    # Off by default: a running Flower turns them on in the workers it sees by itself.
    task_events: bool = False

    # history: the time series the dashboard charts, kept in Redis (tokenmill/history.py): a point
    # every step (a run's while it moves, each server's while it is watched), for keep_s
    series_step_s: float = 10.0
    series_keep_s: float = 7 * 86400.0
    # the dashboard answers only requests whose Host names loopback, its bound address or one of
    # these (host names or IP addresses, comma-separated): a web page cannot read it by DNS rebinding
    dashboard_allowed_hosts: str = ""

    # `tokenmill api` (producer/api): bearer keys, comma-separated (empty: loopback only, no key);
    # the largest file it takes (OpenAI's Batch API: 200 MB); how often it advances batches
    api_keys: str = field(default="", repr=False)
    api_max_file_bytes: int = 64 << 30
    api_poll_s: float = 1.0
    api_allowed_hosts: str = ""  # as dashboard_allowed_hosts, for the API

    # quality while it runs (tokenmill/quality.py): each job's flags are judged as it commits
    # (off: nothing judged, no rule trips), rated over a window of each partition's latest
    # judged jobs; quality_stop: the stop rules of a run enqueued without --quality-stop
    # (`;`-separated, e.g. "length_share>0.3@200;repetition>0.05@50")
    quality_signals: bool = True
    quality_window_jobs: int = 200
    quality_stop: str = ""
    # a reference server a run is judged against (`enqueue --quality-reference`), the share of
    # jobs scored there (`--quality-sample`) and the least a partition (tokenmill/quality_drift.py)
    quality_reference_url: str = ""
    quality_sample: float = 0.02
    quality_sample_min: int = 30
    # one deadline for a sampled job's scoring there (its three requests: every connect and read
    # waits at most what is left of it); the run's scoring lock outlives it by 30 s
    quality_reference_timeout_s: float = 600.0

    # the result store: done results are sealed into Parquet shards there (producer/sealing.py)
    results_url: str = ""  # a directory or an fsspec URL; empty: results_location's default
    seal_batch_jobs: int = 1000  # a partition's results are sealed once this many are done...
    seal_after_s: float = 60.0  # ...or once they have waited this long (from a sealer's first sight)
    seal_check_s: float = 5.0  # how often a sealer looks

    @property
    def server_urls(self) -> tuple[str, ...]:
        """``server_url`` split on commas (several servers, or one router)."""
        return tuple(u.strip().rstrip("/") for u in self.server_url.split(",") if u.strip())

    @property
    def quality_stop_rules(self) -> tuple[str, ...]:
        """``quality_stop`` split on ``;`` (each checked where it is used: ``enqueue``)."""
        return tuple(e.strip() for e in self.quality_stop.split(";") if e.strip())

    @property
    def results_location(self) -> str:
        """Where shards go: ``results_url``, else the local default
        ``$XDG_DATA_HOME/tokenmill/results`` (``~/.local/share/tokenmill/results``)."""
        if self.results_url:
            return self.results_url
        base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
        return os.path.join(base, "tokenmill", "results")

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``TOKENMILL_<NAME>`` variables, then ``overrides`` (None means unset)."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _parse(f, raw, f"{ENV_PREFIX}{f.name.upper()}")
        for name, value in overrides.items():
            if value is None:
                continue
            if name not in {f.name for f in fields(cls)}:
                raise ConfigError(f"unknown setting {name!r}")
            values[name] = value
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        redis_url.check(self.redis_url, f"TOKENMILL_REDIS_URL {redact_url(self.redis_url)!r}")
        for url in self.server_urls:
            if urlsplit(url).scheme not in ("http", "https"):
                raise ConfigError(f"TOKENMILL_SERVER_URL {redact_url(url)!r} must be an http(s) URL")
        if not self.server_urls:
            raise ConfigError("TOKENMILL_SERVER_URL is empty")
        positive = ("lease_ttl_s", "reaper_period_s", "stall_timeout_s", "total_timeout_s", "api_poll_s")
        for name in (*positive, "quality_reference_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.quality_sample <= 1 or self.quality_sample_min < 0:
            raise ConfigError(
                f"quality_sample must be in [0, 1] and quality_sample_min not negative, got "
                f"{self.quality_sample} and {self.quality_sample_min}"
            )
        for name in ("quality_window_jobs", "seal_batch_jobs", "admission_pace_group"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("seal_after_s", "seal_check_s", "server_affinity_wait_s", "server_prefill_wait_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must not be negative, got {getattr(self, name)}")
        fractions = ("admission_queue_share", "admission_fraction", "admission_usage_ceiling")
        for name in (*fractions, "admission_backoff", "admission_reserve"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.series_step_s <= 0 or self.series_keep_s < self.series_step_s:
            raise ConfigError(
                f"series_step_s must be positive and series_keep_s at least one step, got "
                f"{self.series_step_s} and {self.series_keep_s}"
            )
        if self.event_loop not in EVENT_LOOPS:
            choices = ", ".join(EVENT_LOOPS)
            raise ConfigError(f"TOKENMILL_EVENT_LOOP={self.event_loop!r} must be one of {choices}")
        if self.admission_poll_s <= 0 or self.admission_queue_target < 1:
            raise ConfigError("admission_poll_s must be positive and admission_queue_target at least 1")
        for name in (f.name for f in fields(self) if f.name.startswith("input_max_")):
            if getattr(self, name) < 1:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be at least 1, got {getattr(self, name)}")


def _parse(f: dataclasses.Field[Any], raw: str, source: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    try:
        if kind.startswith("bool"):
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise ConfigError(f"{source}={raw!r} is not a valid {kind}") from None
    return raw
