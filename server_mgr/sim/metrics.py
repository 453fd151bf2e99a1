"""``GET /metrics`` (only with ``--enable-metrics``): SGLang's ``sglang:*`` names (§2.7).

Scheduler gauges hold the values of the last Prefill/Decode log event, as on the real server;
the tokenizer-side counters are updated as requests finish. As on SGLang 0.5.23, the counters of
events (retractions, aborts, cached tokens) appear only once the first such event happened.
"""

from __future__ import annotations

from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from server_mgr.sim.state import STATE, SimState

SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
TOKENIZER_LABELS = ("model_name", "engine_type")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LAZY_COUNTERS = frozenset({"cached_tokens", "num_aborted_requests"})


class SimCollector(Collector):
    """Builds every metric at scrape time from the sim's state."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state = self.state
        name = state.cfg.model_name
        snap = state.scheduler.snapshot
        gauges = {
            "num_running_reqs": ("The number of running requests.", snap.num_running_reqs),
            "num_queue_reqs": ("The number of requests in the waiting queue.", snap.num_queue_reqs),
            "num_grammar_queue_reqs": ("The number of requests in the grammar waiting queue.", 0),
            "num_used_tokens": ("The number of used tokens.", snap.num_used_tokens),
            "token_usage": ("The token usage.", snap.token_usage),
            "gen_throughput": ("The generation throughput (token/s).", snap.gen_throughput),
            "cache_hit_rate": ("The prefix cache hit rate.", 0.0),
            "num_retracted_reqs": ("The number of retracted requests.", snap.num_retracted_reqs),
            "num_paused_reqs": ("The number of paused requests.", 0),
            "is_cuda_graph": ("Whether the batch is using CUDA graph.", 1.0),
            "max_total_num_tokens": (
                "Maximum total number of tokens in the KV cache pool.",
                state.cfg.max_total_tokens,
            ),
            "context_len": ("The context length of the model.", state.cfg.context_len),
            "kv_used_tokens": ("KV cache tokens in use.", snap.num_used_tokens),
            "kv_available_tokens": (
                "KV cache tokens available.",
                state.cfg.max_total_tokens - snap.num_used_tokens,
            ),
        }
        sched_values = [name, "unified", "0", "0", "0"]
        for metric, (doc, value) in gauges.items():
            g = GaugeMetricFamily(f"sglang:{metric}", doc, labels=SCHEDULER_LABELS)
            g.add_metric(sched_values, float(value))
            yield g
        if state.scheduler.retracted_total:
            retracted = CounterMetricFamily(
                "sglang:num_retracted_requests",
                "Total number of retracted requests.",
                labels=SCHEDULER_LABELS,
            )
            retracted.add_metric(sched_values, float(state.scheduler.retracted_total))
            yield retracted
        c = state.counters
        counters = {
            "prompt_tokens": ("Number of prefill tokens processed.", c.prompt_tokens),
            "generation_tokens": ("Number of generation tokens processed.", c.generation_tokens),
            "cached_tokens": ("Number of cached prompt tokens.", 0),
            "num_requests": ("Number of requests processed.", c.requests),
            "num_aborted_requests": ("Number of requests aborted.", c.aborted_requests),
        }
        for metric, (doc, value) in counters.items():
            if not value and metric in LAZY_COUNTERS:
                continue
            m = CounterMetricFamily(f"sglang:{metric}", doc, labels=TOKENIZER_LABELS)
            m.add_metric([name, "unified"], float(value))
            yield m


def render(state: SimState) -> bytes:
    """The Prometheus text exposition of the sim's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SimCollector(state))
    return generate_latest(registry)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.metrics_reads += 1
    return web.Response(body=render(state), headers={"Content-Type": CONTENT_TYPE})
