"""The sim's settings: SGLang's own flags plus the sim-only ``--sim-*`` knobs.

Derived limits follow SGLang 0.5.23's tokenizer manager and scheduler: a request may hold at
most ``max_req_len = min(context_len - 1, max_total_tokens - 1)`` tokens, and its input at most
``max_req_len - 5``.
"""

from __future__ import annotations

from dataclasses import dataclass

VERSION = "0.5.23"
# Figures the startup lines and /server_info report; the sim has no GPU, so these pretend to be
# one 80 GB H100 holding an 8B bf16 model.
GPU_TOTAL_GB = 79.11
WEIGHTS_GB = 15.06
KV_BYTES_PER_TOKEN = 131072  # 32 layers x 8 kv heads x 128 dims x 2 (K, V) x 2 bytes
CHUNKED_PREFILL_SIZE = 8192
MAX_PREFILL_TOKENS = 16384
CUDA_GRAPH_MAX_BS = 256
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes")  # SGLang's names of the one format the sim writes


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything the sim server is launched with. Units are in the names."""

    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str = "sim-model"
    served_model_name: str | None = None
    max_total_tokens: int = 200000
    context_length: int | None = None  # --context-length as given; None: the model's
    max_running_requests: int = 1024
    max_queued_requests: int | None = None
    api_key: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    constrained_json_disable_any_whitespace: bool = False
    mem_fraction_static: float = 0.88
    tp_size: int = 1
    stream_interval: int = 1
    decode_log_interval: int = 40
    load_snapshot_publish_interval: int = 15
    enable_metrics: bool = False
    allow_auto_truncate: bool = False
    log_level: str = "info"
    skip_server_warmup: bool = False

    # sim-only knobs
    startup_delay_s: float = 0.5
    warmup_s: float = 0.2
    health_latency_s: float = 1.0
    health_timeout_s: float = 20.0
    drain_poll_s: float = 5.0
    step_ms: float = 10.0
    step_ms_per_req: float = 0.05
    prefill_tokens_per_ms: float = 200.0
    mean_output_tokens: int = 200
    model_context_length: int = 32768  # what the model's config.json says
    crash_diagnostics_s: float = 5.0
    refuse_continuations: bool = False
    crash_after_requests: int | None = None
    error_every: int | None = None
    stall_every: int | None = None
    oom_above: float | None = None
    oom_below: float | None = None
    perturb: float = 0.0
    seed: int = 0

    @property
    def model_name(self) -> str:
        """The served model name (``--served-model-name``, else the model path)."""
        return self.served_model_name or self.model_path

    @property
    def context_len(self) -> int:
        """The context length in force: ``--context-length``, else the model's own."""
        return self.context_length or self.model_context_length

    @property
    def max_req_len(self) -> int:
        """Most tokens (input + output) one request may hold."""
        return min(self.context_len - 1, self.max_total_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        """Longest input the scheduler accepts."""
        return self.max_req_len - 5

    @property
    def rank_prefix(self) -> str:
        """The scheduler's log prefix: `` TP0`` only when tensor parallelism is on."""
        return " TP0" if self.tp_size > 1 else ""

    def validate(self) -> None:
        """Refuse what SGLang's ``check_server_args`` would refuse (ValueError names the flag)."""
        if ":" in self.model_name:
            raise ValueError(
                "served_model_name cannot contain a colon (':') character. "
                f"Invalid value: {self.model_name!r}"
            )
        for name in ("max_total_tokens", "context_len", "max_running_requests"):
            if getattr(self, name) < 1:
                name = "context_length" if name == "context_len" else name
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if (
            min(
                self.stream_interval,
                self.decode_log_interval,
                self.tp_size,
                self.load_snapshot_publish_interval,
            )
            < 1
        ):
            raise ValueError(
                "--stream-interval, --decode-log-interval, --load-snapshot-publish-interval and "
                "--tp-size must be >= 1"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {self.tool_call_parser!r}: the sim writes tool calls in the "
                f"Qwen 2.5 format only ({', '.join(TOOL_CALL_PARSERS)})"
            )
        if not 0.0 <= self.perturb <= 1.0:
            raise ValueError(f"--sim-perturb must be in [0, 1], got {self.perturb}")
