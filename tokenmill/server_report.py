"""What an SGLang server reports about its work: ``/v1/loads`` and ``/metrics``.

Shared by the server manager (live figures for ``server status``) and the workers (the closed
loop of admission). ``/v1/loads`` (0.5.10+) is refreshed by the scheduler about once a second
(seen on 0.5.23) and needs the API key when the server has one; ``/metrics`` needs
``--enable-metrics`` and no key. Counters of events (retractions) appear on ``/metrics`` only
after the first event, so a missing counter on a page that answered means zero.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import NamedTuple

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


class Load(NamedTuple):
    """A server's work as it reports it, summed over its data-parallel ranks."""

    running: int
    waiting: int
    used_tokens: int
    capacity: int


def loads(base_url: str, api_key: str | None, timeout_s: float) -> Load:
    """``/v1/loads``; raises OSError or ValueError when it does not answer one."""
    items = get_json(base_url + "/v1/loads", api_key, timeout_s).get("loads")
    if not isinstance(items, list) or not items:
        raise ValueError(f"{base_url}/v1/loads has no loads")
    return Load(
        sum(int(x.get("num_running_reqs", 0)) for x in items),
        sum(int(x.get("num_waiting_reqs", 0)) for x in items),
        sum(int(x.get("num_used_tokens", 0)) for x in items),
        sum(int(x.get("max_total_num_tokens", 0)) for x in items),
    )


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
        load = loads(base_url, api_key, timeout_s)
        return load.running + load.waiting
    except (OSError, ValueError):
        pass
    if not metrics_enabled:
        return None
    try:
        figures = metrics(base_url, timeout_s)
    except (OSError, ValueError):
        return None
    return int(figures.get("running_req", 0) + figures.get("queue_req", 0))
