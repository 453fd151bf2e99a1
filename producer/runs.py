"""Runs: every run in this Redis with its counts, tokens and times, newest first.

Read from each run's counters and stats hash (O(runs x partitions), never a scan of jobs).
Times come from the Redis clock: the first enqueue, and the last enqueue, commit, failure,
release, cancel or retry (a job streaming without finishing does not count).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from producer.status import totals_of
from tokenmill import keys
from tokenmill.counts import run_counts
from tokenmill.errors import ConfigError
from tokenmill.replies import text

if TYPE_CHECKING:
    from rich.table import Table

    from tokenmill.quick_redis import ReadClient

COLUMNS = ("queued", "running", "done", "failed", keys.CANCELLED)


def list_runs(client: ReadClient) -> list[dict[str, Any]]:
    """One document per run: ``run``, ``partitions`` ({name: counts}), ``totals``,
    ``completion_tokens``, ``prompt_tokens``, ``first_enqueue_at`` and ``last_activity_at``
    (unix seconds, null when unknown); newest first enqueue first."""
    out: list[dict[str, Any]] = []
    for raw in client.smembers(keys.runs()):
        try:
            run = keys.check_run(text(raw))
        except ConfigError:
            continue  # not a tokenmill run name: nothing of ours can live under it
        parts = run_counts(client, run)
        stats = {text(a): int(b) for a, b in client.hgetall(keys.RunKeys(run).stats()).items()}
        out.append(
            {
                "run": run,
                "partitions": parts,
                "totals": totals_of(parts),
                "completion_tokens": stats.get("completion_tokens", 0),
                "prompt_tokens": stats.get("prompt_tokens", 0),
                "first_enqueue_at": _seconds(stats.get("first_enqueue_ms")),
                "last_activity_at": _seconds(stats.get("last_activity_ms")),
            }
        )
    out.sort(key=lambda d: (-(d["first_enqueue_at"] or 0.0), d["run"]))
    return out


def _seconds(ms: int | None) -> float | None:
    return ms / 1000 if ms else None


def render_runs(runs: list[dict[str, Any]]) -> Table | str:
    """The human view: one row per run."""
    if not runs:
        return "no runs in this Redis (tokenmill enqueue FILE --run NAME creates one)"
    from rich.table import Table

    now = time.time()
    table = Table(box=None, pad_edge=False)
    for col in ("run", "parts", "total", *COLUMNS, "tokens", "first enqueue", "last activity"):
        table.add_column(col, justify="left" if col in ("run", "first enqueue", "last activity") else "right")
    for doc in runs:
        t = doc["totals"]
        first, last = doc["first_enqueue_at"], doc["last_activity_at"]
        table.add_row(
            doc["run"],
            str(len(doc["partitions"])),
            str(t["total"]),
            *(str(t.get(state, 0)) for state in COLUMNS),
            f"{doc['completion_tokens']:,}",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(first)) if first else "-",
            _ago(now - last) if last else "-",
        )
    return table


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= 2 * size:
            return f"{s // size}{unit} ago"
    return f"{s}s ago"
