"""Status: a run's progress from the ledger's counters (O(partitions), never a scan of jobs)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from tokenmill import keys
from tokenmill import servers as server_records
from tokenmill.admission_view import admission_view, length_view
from tokenmill.counts import run_counts
from tokenmill.outputs import outputs_view
from tokenmill.quality_view import quality_view
from tokenmill.url_secrets import redact_url

if TYPE_CHECKING:
    from tokenmill.quick_redis import ReadClient

WINDOW_S = 60


def totals_of(partitions: dict[str, dict[str, int]]) -> dict[str, int]:
    """Counts summed over partitions, and ``total``; ``cancelled`` only if the partitions carry it."""
    totals = dict.fromkeys(keys.STATES, 0)
    for counts in partitions.values():
        for state, n in counts.items():
            totals[state] = totals.get(state, 0) + n
    totals["total"] = sum(totals.values())
    return totals


def run_status(client: ReadClient, run: str, server_urls: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``status --json`` document (README), plus admission figures per server, the run's
    completion-length curve admission projects from, what its outputs look like (finish
    reasons, completion and reasoning lengths: :func:`~tokenmill.outputs.outputs_view`), their
    quality (each partition's as its ``quality``, and the run's) and the run's pause, if any
    (:func:`~tokenmill.quality_view.quality_view`)."""
    k = keys.RunKeys(run)
    counts = run_counts(client, run)
    totals = totals_of(counts)
    quality = quality_view(client, run, counts)
    partitions: dict[str, dict[str, Any]] = {
        p: {**c, "quality": quality.partitions[p]} for p, c in counts.items()
    }
    now = int(client.time()[0])
    # the last WINDOW_S seconds, this one included: a run whose every commit fell in the second
    # the status is read in (a small run on a fast server) had shown 0 tokens/s
    window = [str(t) for t in range(now - WINDOW_S + 1, now + 1)]
    pipe = client.pipeline(transaction=False)
    pipe.hmget(k.throughput(), window)
    pipe.hgetall(k.stats())
    pipe.hgetall(k.failures())
    pipe.hgetall(k.failure_last())
    pipe.hgetall(k.sealed())
    pipe.get(k.results_store())
    pipe.scard(k.seals_pending())
    pipe.get(keys.dead_letters_count())
    for partition in partitions:
        pipe.scard(k.shards(partition))
    tput, stats, failures, last, sealed, store, sealing, dead, *shards = pipe.execute()
    tokens_per_s = sum(int(v or 0) for v in tput) / WINDOW_S
    stats = {a.decode(): int(b) for a, b in stats.items()}
    done = totals["done"]
    remaining = totals["queued"] + totals["running"]
    eta_s = None
    if remaining == 0:
        eta_s = 0.0
    elif tokens_per_s > 0 and done > 0:
        per_job = stats.get("completion_tokens", 0) / done
        eta_s = round(remaining * per_job / tokens_per_s, 1)
    records = server_records.load_all(client)
    servers = [  # as the records are, but the url redacted and without updated_at
        {k: redact_url(v) if k == "url" else v for k, v in asdict(r).items() if k != "updated_at"}
        for r in records
    ]
    managed = {r.url for r in records}
    names = [r.name for r in records] + [server_records.name_of(u) for u in server_urls if u not in managed]
    return {
        "run": run,
        "partitions": partitions,
        "totals": totals,
        "tokens_per_s": round(tokens_per_s, 1),
        "eta_s": eta_s,
        "failures": {a.decode(): int(b) for a, b in failures.items()},
        "failure_messages": {a.decode(): b.decode() for a, b in last.items()},
        "stats": stats,
        "servers": servers,
        "admission": {name: admission_view(client, name) for name in names},
        "lengths": length_view(client, run),
        "outputs": outputs_view(client, run),
        "quality": quality.run,
        "paused": quality.paused,
        "results": {  # sealed jobs also count as done above
            "store": redact_url(store.decode()) if store else None,
            "sealed": {a.decode(): int(b) for a, b in sealed.items()},
            "shards": sum(int(n) for n in shards),
            "sealing": int(sealing),
        },
        "dead_letters": int(dead or 0),  # of every run: the queues are shared (tokenmill.dead_letters)
        "at": time.time(),
    }
