"""What an SGLang server reports about its work: ``/v1/loads`` and ``/metrics``.

Shared by the server manager (live figures for ``server status``) and the workers (the closed
loop of admission). ``/v1/loads`` (0.5.10+) is refreshed by the scheduler about once a second
(seen on 0.5.23) and needs the API key when the server has one; ``/metrics`` needs
``--enable-metrics`` and no key. Counters of events (retractions) appear on ``/metrics`` only
after the first event, so a missing counter on a page that answered means zero.

Behind sglang-router (0.3.2) neither exists (404): the router serves ``/engine_metrics``
instead, every worker's ``/metrics`` gathered on each call, each sample labelled with its
``worker_addr`` and named ``sglang_<name>`` where the server says ``sglang:<name>`` (seen on
0.3.2 in front of SGLang 0.5.23). It needs the router's API key when it has one, and figures only
from workers started with ``--enable-metrics``. Summed over the workers, they make the router one
server for admission: its window is the requests in flight through it, its pool the workers'
pools together; where each request goes stays the router's choice.
"""

from __future__ import annotations

import urllib.error
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from tokenmill.capacity import get_bytes, get_json
from tokenmill.url_secrets import redact_url

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
CAPACITY_METRIC = "sglang:max_total_num_tokens"  # emitted once at startup (0.5.23)
# /v1/loads' figures of a rank, in the order of Load's fields
LOADS_FIELDS = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens")
ROUTER_PREFIX = "sglang_"  # sglang-router's /engine_metrics renames sglang:<name> to this
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
    """``/v1/loads``, or behind sglang-router its workers' figures summed from
    ``/engine_metrics``; raises OSError or ValueError when neither answers one."""
    try:
        items = get_json(base_url + "/v1/loads", api_key, timeout_s).get("loads")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
        return router_load(base_url, api_key, timeout_s)
    if not isinstance(items, list) or not items:
        raise ValueError(f"{redact_url(base_url)}/v1/loads has no loads")
    return Load(*(sum(int(x.get(name, 0)) for x in items) for name in LOADS_FIELDS))


def metrics(base_url: str, timeout_s: float, api_key: str | None = None) -> dict[str, float]:
    """Live figures from ``/metrics`` (only served with ``--enable-metrics``), or behind
    sglang-router from ``/engine_metrics`` (summed over its workers)."""
    try:
        text = _text(base_url + "/metrics", None, timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise
        text = _text(base_url + "/engine_metrics", api_key, timeout_s)
    return parse_metrics(text)


def router_load(base_url: str, api_key: str | None, timeout_s: float) -> Load:
    """The load of every worker behind sglang-router, summed: its ``/engine_metrics``."""
    url = base_url + "/engine_metrics"
    figures = parse_metrics(_text(url, api_key, timeout_s), extra=(CAPACITY_METRIC,))
    if CAPACITY_METRIC not in figures or "running_req" not in figures:
        raise ValueError(
            f"{redact_url(url)} has no SGLang scheduler figures (workers without --enable-metrics?)"
        )
    return Load(
        int(figures["running_req"]),
        int(figures.get("queue_req", 0)),
        int(figures.get("num_used_tokens", 0)),
        int(figures[CAPACITY_METRIC]),
    )


def parse_metrics(text: str, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """The scheduler gauges of a Prometheus page, by live name (``extra`` Prometheus names kept
    as they are, summed); TP rank 0 only, summed over DP ranks and over a router's workers."""
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(_samples_of(text, (*METRIC_NAMES, *extra))):
        for sample in family.samples:
            prom = sample.name
            if prom.startswith(ROUTER_PREFIX):
                prom = "sglang:" + prom[len(ROUTER_PREFIX) :]
            name = prom if prom in extra else METRIC_NAMES.get(prom)
            if name is None or sample.labels.get("tp_rank", "0") != "0":
                continue
            values.setdefault(name, []).append(float(sample.value))
    summed = _SUMMED.union(extra)
    return {name: sum(v) if name in summed else sum(v) / len(v) for name, v in values.items()}


def _samples_of(text: str, names: tuple[str, ...]) -> str:
    """The page's sample lines of ``names`` (as SGLang or the router spells them), without its
    other families and its comments: the parser then reads a few lines, not the whole page (on
    SGLang 0.5.23 ~600 lines of histograms, which cost ~19 ms of CPU to parse, twice a second in
    the load watch). Samples parse the same without their ``# TYPE`` line."""
    wanted = {*names, *(ROUTER_PREFIX + n.removeprefix("sglang:") for n in names)}
    prefixes = tuple(wanted)
    kept = [
        line
        for line in text.splitlines()
        if line.startswith(prefixes) and line.split("{", 1)[0].split(" ", 1)[0] in wanted
    ]
    return "\n".join(kept) + "\n"


def _text(url: str, api_key: str | None, timeout_s: float) -> str:
    return get_bytes(url, api_key, timeout_s).decode("utf-8", "replace")


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
