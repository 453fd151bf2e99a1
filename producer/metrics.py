"""``tokenmill metrics``: a Prometheus endpoint that reads the ledger at scrape time.

Nothing is counted in this process: every scrape reads the runs' counters, stats and failure
hashes, the broker lists, the admission keys and the published server records from Redis, so
any number of exporters (or none) can run, and a restart loses nothing. Metric names start with
``tokenmill_``; counters mirror the ledger's monotonic hash fields.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import click
import redis
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from tokenmill import keys
from tokenmill import servers as server_records
from tokenmill.errors import ConfigError
from tokenmill.ledger import Ledger
from tokenmill.quality import DRIFT, RATE_NAMES, SIGNALS
from tokenmill.quality_view import JUDGED, quality_view
from tokenmill.replies import text
from tokenmill.url_secrets import redact_url

log = logging.getLogger("tokenmill.metrics")

DEFAULT_PORT = 9640

# run stats hash field -> (counter name without _total, help)
RUN_STATS = {
    "completion_tokens": ("tokenmill_completion_tokens", "Completion tokens of committed jobs."),
    "prompt_tokens": ("tokenmill_prompt_tokens", "Prompt tokens of committed jobs."),
    "continued_jobs": ("tokenmill_continued_jobs", "Jobs that finished by continuing a checkpoint."),
    "continued_tokens": ("tokenmill_continued_tokens", "Tokens reused from checkpoints."),
    "truncated": ("tokenmill_truncated_jobs", "Jobs done with finish_reason length."),
    "restarted_jobs": ("tokenmill_restarted_jobs", "Jobs that started over, throwing a checkpoint away."),
    "discarded_tokens": ("tokenmill_discarded_tokens", "Checkpointed tokens thrown away by restarts."),
}
# admission used hash field -> (metric name, help, is a counter)
ADMISSION_FIELDS = {
    "total": ("tokenmill_admission_used_tokens", "Tokens held by admission slots on the server.", False),
    "budget": ("tokenmill_admission_budget_tokens", "The server's admission token budget.", False),
    "n": ("tokenmill_admission_in_flight", "Requests admitted on the server and not yet released.", False),
    "window": ("tokenmill_admission_window", "Requests the closed loop lets in flight on the server.", False),
    "admitted": ("tokenmill_admission_admitted", "Requests admitted on the server.", True),
    "refused": ("tokenmill_admission_refused", "Admission attempts refused for lack of room.", True),
}
ADMISSION_READ = [*ADMISSION_FIELDS, *keys.QUEUES, *(f"cap:{q}" for q in keys.QUEUES)]  # of the used hash


def _num(value: Any) -> float | None:
    try:
        return float(text(value))
    except (TypeError, ValueError):
        return None


class LedgerCollector(Collector):
    """Reads runs, queues, admission and servers from Redis on every ``collect``."""

    def __init__(self, client: redis.Redis) -> None:
        self.r = client

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("tokenmill_redis_up", "Whether this scrape could read Redis.")
        families: list[Metric] | None = None
        try:
            families = [*self._runs(), *self._queues(), *self._servers()]
        except redis.RedisError as exc:
            log.warning("scrape failed: cannot read Redis: %s", exc)
        up.add_metric([], 0 if families is None else 1)
        yield up
        yield from families or ()

    # -- runs -------------------------------------------------------------------------------

    def _runs(self) -> list[Metric]:
        families = _RunFamilies()
        for raw in sorted(text(x) for x in self.r.smembers(keys.runs())):
            try:
                run = keys.check_run(raw)
            except ConfigError:
                log.warning("skipping run %r: not a valid run name", raw)
                continue
            families.add(self.r, run)
        return families.all()

    def _queues(self) -> list[Metric]:
        family = GaugeMetricFamily(
            "tokenmill_queue_messages", "Messages waiting in the broker queue.", labels=["queue"]
        )
        dead = CounterMetricFamily(
            "tokenmill_dead_letters", "Poison messages set aside off the queues, not run (every run)."
        )
        pipe = self.r.pipeline(transaction=False)
        for queue in keys.QUEUES:
            pipe.llen(keys.broker_queue(queue))
        pipe.get(keys.dead_letters_count())
        *depths, n_dead = pipe.execute()
        for queue, n in zip(keys.QUEUES, depths, strict=True):
            family.add_metric([queue], n)
        dead.add_metric([], int(n_dead or 0))
        return [family, dead]

    # -- servers and admission --------------------------------------------------------------

    def _servers(self) -> list[Metric]:
        """The server records, and each one's admission: slots (zset cardinality) and the
        used-tokens hash; fields are absent until admission runs."""
        records = server_records.load_all(self.r)
        pipe = self.r.pipeline(transaction=False)
        for rec in records:
            pipe.zcard(keys.admission(rec.name))
            pipe.hmget(keys.admission_used(rec.name), ADMISSION_READ)
        replies = pipe.execute()
        return _server_families(records, replies)


class _RunFamilies:
    """The per-run metric families of one scrape."""

    def __init__(self) -> None:
        self.jobs = GaugeMetricFamily(
            "tokenmill_jobs", "Jobs by run, partition and state.", labels=["run", "partition", "state"]
        )
        self.failures = CounterMetricFamily(
            "tokenmill_job_failures", "Jobs that ended failed, by class.", labels=["run", "class"]
        )
        self.stats = {
            f: CounterMetricFamily(name, doc, labels=["run"]) for f, (name, doc) in RUN_STATS.items()
        }
        self.delayed = GaugeMetricFamily(
            "tokenmill_delayed_retries", "Queued jobs waiting out a retry backoff.", labels=["run"]
        )
        self.backlog = GaugeMetricFamily(
            "tokenmill_backlog", "Queued jobs not yet published to the broker.", labels=["run", "queue"]
        )
        self.judged = CounterMetricFamily(
            "tokenmill_quality_judged", "Jobs whose output was judged at commit.", labels=["run", "partition"]
        )
        self.flagged = CounterMetricFamily(
            "tokenmill_quality_flagged",
            "Judged jobs with the quality flag set (signal: a flag of tokenmill.quality.SIGNALS).",
            labels=["run", "partition", "signal"],
        )
        self.rates = GaugeMetricFamily(
            "tokenmill_quality_rate",
            "A quality rate over the partition's window of latest judged jobs (signal: the rate's name, "
            "as --quality-stop names it; drift: the reference's mean score difference).",
            labels=["run", "partition", "signal"],
        )
        self.paused = GaugeMetricFamily("tokenmill_run_paused", "1 while the run is paused.", labels=["run"])
        self.reference_up = GaugeMetricFamily(
            "tokenmill_quality_reference_up",
            "0 while the run's reference server fails to score (its jobs wait unjudged), else 1.",
            labels=["run", "partition"],
        )

    def add(self, r: redis.Redis, run: str) -> None:
        """Read and add one run's figures, and its quality: counts since it began, window rates,
        and its pause."""
        k = keys.RunKeys(run)
        pipe = r.pipeline(transaction=False)
        pipe.hgetall(k.stats())
        pipe.hgetall(k.failures())
        pipe.hgetall(k.retried())
        pipe.zcard(k.delayed())
        for queue in keys.QUEUES:
            pipe.llen(k.backlog(queue))
        run_stats, failed_now, retried, delayed, *backlogs = pipe.execute()
        # Every job that ever ended failed: those failed now, and those `retry` sent back.
        failures = Counter({text(c): int(n) for c, n in failed_now.items()})
        failures.update({text(c): int(n) for c, n in retried.items()})
        counts = Ledger(r, run).counts()
        view = quality_view(r, run, counts)
        for partition, by_state in sorted(counts.items()):
            for state, n in by_state.items():
                self.jobs.add_metric([run, partition, state], n)
        stats = {text(a): b for a, b in run_stats.items()}
        for field, family in self.stats.items():
            family.add_metric([run], _num(stats.get(field)) or 0)
        for cls, n in sorted(failures.items()):
            self.failures.add_metric([run, text(cls)], _num(n) or 0)
        self.delayed.add_metric([run], delayed)
        for queue, n in zip(keys.QUEUES, backlogs, strict=True):
            self.backlog.add_metric([run, queue], n)
        for partition, judged in sorted(view.counts.items()):
            self.judged.add_metric([run, partition], judged.get(JUDGED, 0))
            for flag in SIGNALS:
                self.flagged.add_metric([run, partition, flag], judged.get(flag, 0))
        for partition, doc in sorted(view.partitions.items()):
            for name in (*RATE_NAMES, DRIFT):
                if doc.get(name) is not None:
                    self.rates.add_metric([run, partition, name], doc[name])
            if "reference_error" in doc:
                self.reference_up.add_metric([run, partition], 0 if doc["reference_error"] else 1)
        self.paused.add_metric([run], 1 if view.paused else 0)

    def all(self) -> list[Metric]:
        quality = [self.judged, self.flagged, self.rates, self.paused, self.reference_up]
        return [self.jobs, self.failures, *self.stats.values(), self.delayed, self.backlog, *quality]


def _server_families(records: list[server_records.ServerRecord], replies: list[Any]) -> list[Metric]:
    """Each server's record, and its admission from ``replies``: its slot count, then its
    used-hash values (in :data:`ADMISSION_READ` order)."""
    state = GaugeMetricFamily(
        "tokenmill_server_state", "1 for the server's current state, else 0.", labels=["server", "state"]
    )
    info = GaugeMetricFamily(
        "tokenmill_server_info", "The server's engine and URL (always 1).", labels=["server", "engine", "url"]
    )
    capacity = GaugeMetricFamily(
        "tokenmill_server_max_total_num_tokens",
        "KV cache capacity in tokens (from /server_info).",
        labels=["server"],
    )
    context = GaugeMetricFamily(
        "tokenmill_server_context_length_tokens", "The server's context length.", labels=["server"]
    )
    restarts = CounterMetricFamily(
        "tokenmill_server_restarts", "Restarts by the server manager.", labels=["server"]
    )
    updated = GaugeMetricFamily(
        "tokenmill_server_updated_timestamp_seconds",
        "When the server manager last refreshed the record.",
        labels=["server"],
    )
    live = GaugeMetricFamily(
        "tokenmill_server_live", "Live figures the server manager publishes.", labels=["server", "figure"]
    )
    slots = GaugeMetricFamily(
        "tokenmill_admission_slots", "Admission slots held on the server.", labels=["server"]
    )
    fields = {
        f: (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=["server"])
        for f, (name, doc, counter) in ADMISSION_FIELDS.items()
    }
    by_queue = GaugeMetricFamily(
        "tokenmill_admission_queue_tokens",
        "Tokens held by admission slots, by queue.",
        labels=["server", "queue"],
    )
    caps = GaugeMetricFamily(
        "tokenmill_admission_queue_cap_tokens",
        "The most tokens one queue may hold on the server.",
        labels=["server", "queue"],
    )
    for i, rec in enumerate(records):
        for s in dict.fromkeys([*server_records.STATES, rec.state]):
            state.add_metric([rec.name, s], 1 if s == rec.state else 0)
        info.add_metric([rec.name, rec.engine, redact_url(rec.url)], 1)
        if rec.max_total_num_tokens is not None:
            capacity.add_metric([rec.name], rec.max_total_num_tokens)
        if rec.context_length is not None:
            context.add_metric([rec.name], rec.context_length)
        restarts.add_metric([rec.name], rec.restarts)
        updated.add_metric([rec.name], rec.updated_at)
        for figure, value in sorted(rec.live.items()):
            live.add_metric([rec.name, figure], value)
        slots.add_metric([rec.name], replies[2 * i])
        values = {f: _num(v) for f, v in zip(ADMISSION_READ, replies[2 * i + 1], strict=True)}
        for field, family in fields.items():
            if (v := values[field]) is not None:
                family.add_metric([rec.name], v)
        for queue in keys.QUEUES:
            if (v := values[queue]) is not None:
                by_queue.add_metric([rec.name, queue], v)
            if (v := values[f"cap:{queue}"]) is not None:
                caps.add_metric([rec.name, queue], v)
    server = [state, info, capacity, context, restarts, updated, live]
    return [*server, slots, *fields.values(), by_queue, caps]


def registry_for(client: redis.Redis) -> CollectorRegistry:
    """A registry holding only the ledger collector (no process metrics of the exporter)."""
    registry = CollectorRegistry()
    registry.register(LedgerCollector(client))
    return registry


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--redis-url", envvar="TOKENMILL_REDIS_URL", default=None, help="Redis URL (the ledger).")
def metrics(port: int, address: str, redis_url: str | None) -> None:
    """Serve Prometheus metrics for runs, queues, admission and servers at /metrics."""
    from tokenmill import redis_conn
    from tokenmill.settings import Settings

    settings = Settings.load(redis_url=redis_url)
    client = redis_conn.connect(settings, check=False)  # a down Redis shows as tokenmill_redis_up 0
    httpd, _ = start_http_server(port, addr=address, registry=registry_for(client))
    click.echo(
        f"tokenmill metrics on http://{address}:{port}/metrics (redis {redact_url(settings.redis_url)})",
        err=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        httpd.shutdown()
        httpd.server_close()
