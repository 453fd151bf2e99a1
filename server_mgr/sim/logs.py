"""SGLang-shaped log lines on stderr (contract §5): ``[YYYY-mm-dd HH:MM:SS{prefix}] message``.

Scheduler lines carry the rank prefix (`` TP0`` when tp > 1); the HTTP server's lines do not.
No level names, as in SGLang; ``--log-level warning`` hides the INFO lines (Prefill, Decode,
startup and access lines), as it does on the real server.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TextIO

from server_mgr.sim.config import (
    CHUNKED_PREFILL_SIZE,
    CUDA_GRAPH_MAX_BS,
    GPU_TOTAL_GB,
    KV_BYTES_PER_TOKEN,
    MAX_PREFILL_TOKENS,
    WEIGHTS_GB,
    SimConfig,
)


class SimLog:
    """A minimal logger: one formatted write per line, level filtered, flushed at once."""

    def __init__(self, level: str = "info", rank_prefix: str = "", stream: TextIO | None = None):
        numeric = logging.getLevelName(level.upper())
        self.level = numeric if isinstance(numeric, int) else logging.INFO
        self.rank_prefix = rank_prefix
        self.stream = stream or sys.stderr

    def enabled(self, level: int) -> bool:
        return level >= self.level

    def emit(self, level: int, message: str, *, rank: bool = False) -> None:
        """Write ``message`` (may span lines) if ``level`` passes the threshold."""
        if level < self.level:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        prefix = self.rank_prefix if rank else ""
        self.stream.write(f"[{stamp}{prefix}] {message}\n")
        self.stream.flush()

    def info(self, message: str, *, rank: bool = False) -> None:
        self.emit(logging.INFO, message, rank=rank)

    def warning(self, message: str, *, rank: bool = False) -> None:
        self.emit(logging.WARNING, message, rank=rank)

    def error(self, message: str, *, rank: bool = False) -> None:
        self.emit(logging.ERROR, message, rank=rank)

    def access(self, peer: str, method: str, path: str, status: int, reason: str) -> None:
        """A uvicorn-style access line."""
        self.info(f'INFO:     {peer} - "{method} {path} HTTP/1.1" {status} {reason}')


def _gb(value: float) -> str:
    return f"{value:.2f}"


def kv_gb(cfg: SimConfig) -> float:
    """Size of the whole KV pool (K plus V) in GB."""
    return cfg.max_total_tokens * KV_BYTES_PER_TOKEN / 1e9


def graph_gb(cfg: SimConfig) -> float:
    return 0.3 + 0.004 * min(cfg.max_running_requests, CUDA_GRAPH_MAX_BS)


def available_after_pool_gb(cfg: SimConfig) -> float:
    """What the pretend GPU has left once weights and the KV pool are in."""
    return max(0.5, GPU_TOTAL_GB * (1 - cfg.mem_fraction_static) + 1.2)


def server_args_line(cfg: SimConfig) -> str:
    """SGLang's first line: the resolved ServerArgs repr (the fields the sim knows)."""
    fields = {
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "host": cfg.host,
        "port": cfg.port,
        "mem_fraction_static": cfg.mem_fraction_static,
        "max_running_requests": cfg.max_running_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "max_total_tokens": cfg.max_total_tokens,
        "chunked_prefill_size": CHUNKED_PREFILL_SIZE,
        "max_prefill_tokens": MAX_PREFILL_TOKENS,
        "schedule_policy": "fcfs",
        "tp_size": cfg.tp_size,
        "stream_interval": cfg.stream_interval,
        "random_seed": cfg.seed,
        "log_level": cfg.log_level,
        "api_key": None if cfg.api_key is None else "***",
        "served_model_name": cfg.model_name,
        "context_length": cfg.context_length,
        "reasoning_parser": cfg.reasoning_parser,
        "enable_metrics": cfg.enable_metrics,
        "decode_log_interval": cfg.decode_log_interval,
        "allow_auto_truncate": cfg.allow_auto_truncate,
        "skip_server_warmup": cfg.skip_server_warmup,
    }
    inner = ", ".join(f"{k}={v!r}" for k, v in fields.items())
    return f"server_args=ServerArgs({inner})"


def startup_lines_before_pool(cfg: SimConfig) -> list[str]:
    """Scheduler lines up to the weights being loaded."""
    avail = GPU_TOTAL_GB - 0.53
    return [
        "Init torch distributed begin.",
        "Init torch distributed ends. elapsed=0.21 s, mem usage=0.29 GB",
        f"Load weight begin. avail mem={_gb(avail)} GB",
        f"Load weight end. elapsed=3.21 s, type=LlamaForCausalLM, dtype=torch.bfloat16, "
        f"avail mem={_gb(avail - WEIGHTS_GB)} GB, mem usage={_gb(WEIGHTS_GB)} GB.",
    ]


def kv_allocated_lines(cfg: SimConfig) -> list[str]:
    """The KV pool lines (its size is what /server_info reports as max_total_num_tokens)."""
    half = kv_gb(cfg) / 2
    avail = available_after_pool_gb(cfg) + graph_gb(cfg)
    lines = [
        f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {cfg.max_total_tokens}, "
        f"K size: {_gb(half)} GB, V size: {_gb(half)} GB",
        f"Memory pool end. avail mem={_gb(avail)} GB",
        "Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
        f"avail mem={_gb(avail)} GB",
    ]
    return lines


def graph_and_limits_lines(cfg: SimConfig) -> list[str]:
    """The end of graph capture and the ``max_total_num_tokens=...`` line."""
    bs = [
        b
        for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
        if b <= min(cfg.max_running_requests, CUDA_GRAPH_MAX_BS)
    ]
    avail = available_after_pool_gb(cfg)
    lines = [
        f"Capture target decode CUDA graph end. bs={bs}, elapsed=5.37 s, "
        f"mem usage={_gb(graph_gb(cfg))} GB, avail mem={_gb(avail)} GB.",
        f"max_total_num_tokens={cfg.max_total_tokens}, chunked_prefill_size={CHUNKED_PREFILL_SIZE}, "
        f"max_prefill_tokens={MAX_PREFILL_TOKENS}, max_running_requests={cfg.max_running_requests}, "
        f"context_len={cfg.context_len}, available_gpu_mem={_gb(avail)} GB",
    ]
    if cfg.max_total_tokens < cfg.context_len:
        lines.append(
            f"KV pool holds {cfg.max_total_tokens} tokens, fewer than --context-length "
            f"{cfg.context_len}. Requests longer than the pool will be rejected."
        )
    return lines


def uvicorn_lines(cfg: SimConfig) -> list[str]:
    return [
        f"INFO:     Started server process [{os.getpid()}]",
        "INFO:     Waiting for application startup.",
        "INFO:     Application startup complete.",
        f"INFO:     Uvicorn running on http://{cfg.host}:{cfg.port} (Press CTRL+C to quit)",
    ]


def prefill_line(
    new_seq: int,
    new_token: int,
    usage: float,
    running: int,
    queued: int,
    throughput: float,
) -> str:
    """0.5.23 Prefill line (``#running-req`` excludes the new sequences)."""
    return (
        f"Prefill batch, #new-seq: {new_seq}, #new-token: {new_token}, #cached-token: 0, "
        f"token usage: {usage:.2f}, #running-req: {running}, #queue-req: {queued}, "
        f"#pending-token: 0, cuda graph: False, input throughput (token/s): {throughput:.2f}"
    )


def decode_line(running: int, tokens: int, usage: float, throughput: float, queued: int) -> str:
    """0.5.23 Decode line."""
    graph = running <= CUDA_GRAPH_MAX_BS
    return (
        f"Decode batch, #running-req: {running}, #token: {tokens}, token usage: {usage:.2f}, "
        f"cuda graph: {graph}, gen throughput (token/s): {throughput:.2f}, #queue-req: {queued}"
    )


def retract_line(retracted: int, gained: int, old_ratio: float, new_ratio: float) -> str:
    """0.5.23 warning when the KV pool fills during decode."""
    return (
        f"KV cache pool is full. Retract requests. #retracted_reqs: {retracted}, "
        f"#new_tokens_gained: {gained}, #new_token_ratio: {old_ratio:.4f} -> {new_ratio:.4f}"
    )
