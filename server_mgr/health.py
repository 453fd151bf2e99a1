"""HTTP probes of a server: ``/health``, ``/server_info``, ``/metrics``, ``/v1/loads``.

Readiness is ``/health`` answering 200, never ``/v1/models`` (it answers before warmup). A healthy
``/health`` takes about a second (it runs a one-token generation); a wedged one hangs for up to
20 s and then answers 503, so every probe has a timeout and the caller counts a failure streak.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.capacity import get_json

# sglang:<gauge> -> the name published as live.<name> (same vocabulary as the log parser)
METRIC_NAMES = {
    "sglang:num_running_reqs": "running_req",
    "sglang:num_queue_reqs": "queue_req",
    "sglang:token_usage": "token_usage",
    "sglang:gen_throughput": "gen_throughput",
    "sglang:num_used_tokens": "num_used_tokens",
    "sglang:cache_hit_rate": "cache_hit_rate",
    "sglang:num_retracted_reqs": "retracted_reqs",
    "sglang:kv_available_tokens": "kv_available_tokens",
    "sglang:num_retracted_requests_total": "retractions",
    "sglang:num_retractions": "retractions",
}
# Figures that add up across data-parallel ranks (the others are averaged).
_SUMMED = {
    "running_req",
    "queue_req",
    "num_used_tokens",
    "gen_throughput",
    "retracted_reqs",
    "retractions",
    "kv_available_tokens",
}


@dataclass(frozen=True, slots=True)
class Probe:
    """The outcome of one ``/health`` probe."""

    ok: bool
    status: int | None
    error: str
    elapsed_s: float


def probe_health(base_url: str, timeout_s: float) -> Probe:
    """GET ``/health``: ok on 200; a refused connection, a 503 or a timeout is not ok."""
    start = time.monotonic()
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout_s) as resp:
            status = resp.status
            error = ""
    except urllib.error.HTTPError as exc:
        status, error = exc.code, f"/health answered {exc.code}"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        status, error = None, f"/health: {reason}"
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            error = f"/health did not answer within {timeout_s:g} s"
    return Probe(status == 200, status, error, time.monotonic() - start)


def metrics(base_url: str, timeout_s: float) -> dict[str, float]:
    """Live figures from ``/metrics`` (only served with ``--enable-metrics``)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode("utf-8", "replace")
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """The scheduler gauges of a Prometheus page, by live name; TP rank 0 only, summed over DP."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = METRIC_NAMES.get(sample.name)
            if name is None or sample.labels.get("tp_rank", "0") != "0":
                continue
            values.setdefault(name, []).append(float(sample.value))
    return {name: sum(v) if name in _SUMMED else sum(v) / len(v) for name, v in values.items()}


def in_flight(
    base_url: str, api_key: str | None, timeout_s: float, *, metrics_enabled: bool = False
) -> int | None:
    """Running plus waiting requests: ``/v1/loads`` (0.5.10+), else ``/metrics`` when enabled.

    None when neither answers (0.5.5 without metrics): the caller falls back to the log.
    """
    try:
        loads = get_json(base_url + "/v1/loads", api_key, timeout_s).get("loads")
    except (OSError, ValueError):
        loads = None
    if isinstance(loads, list):
        return sum(
            int(item.get("num_running_reqs", 0)) + int(item.get("num_waiting_reqs", 0))
            for item in loads
            if isinstance(item, dict)
        )
    if not metrics_enabled:
        return None
    try:
        figures = metrics(base_url, timeout_s)
    except (OSError, ValueError):
        return None
    return int(figures.get("running_req", 0) + figures.get("queue_req", 0))
