"""The human view of a run's status (rich): progress per partition, throughput, failures, servers."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from tokenmill import keys
from tokenmill.quality import RATE_NAMES


def _eta(eta_s: float | None) -> str:
    if eta_s is None:
        return "unknown"
    s = int(eta_s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def _lengths_line(lv: dict[str, Any]) -> str:
    """What admission's projections rest on: the run's completion lengths so far."""
    if not lv.get("ended") and not lv.get("running"):
        return "completion lengths: none seen yet (each request projected to reach max_tokens)"
    p50, p90 = lv.get("p50"), lv.get("p90")
    return (
        f"completion lengths: {lv['ended']} ended, {lv['running']} running; "
        f"median {p50 if p50 is not None else '?'}, p90 {p90 if p90 is not None else '?'}, "
        f"mean {lv.get('mean_known') or '?'}; "
        f"{lv['unknown_tail']:.0%} beyond the data (projected to reach max_tokens)"
    )


def _sealed_line(results: dict[str, Any], done: int) -> str:
    """How much of the done work has left Redis for the result store."""
    line = f"sealed: {sum(results['sealed'].values())} of {done} done results, in {results['shards']} shards"
    line += f" at {results['store']}"
    return line + (f" ({results['sealing']} shard(s) being sealed)" if results["sealing"] else "")


def _dead_letters_line(n: int) -> str:
    """Poison messages the workers set aside (of every run: the queues are shared)."""
    return (
        f"dead letters: {n} message(s) on the queues could not be run and were set aside (all runs); "
        f"the latest, with their reasons: redis-cli LRANGE {keys.dead_letters()} 0 9"
    )


def _paused_line(run: str, paused: dict[str, Any]) -> str:
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(paused["at"]))
    return (
        f"PAUSED since {at} by {paused.get('by') or '?'}: {paused['reason']} (tokenmill resume --run {run})"
    )


def _quality_lines(doc: dict[str, Any]) -> list[str]:
    """A Quality line per partition with judged jobs: each rate over its window, and drift."""
    lines = []
    for name, c in sorted(doc["partitions"].items()):
        q = c.get("quality") or {}
        if not q.get("judged"):
            continue
        rates = ", ".join(f"{r} {v:.1%}" for r, v in q.items() if r in RATE_NAMES and v is not None)
        drift = (
            f", drift {q['drift']:+.3f} ± {q.get('drift_ci95') or 0:.3f}"
            if q.get("drift") is not None
            else ""
        )
        lines.append(f"quality {name}: {q['judged']} judged; over the last {q['window']}: {rates}{drift}")
    return lines


def render(doc: dict[str, Any]) -> Group:
    """One screen: what a person watching a run needs, without reading logs."""
    t = doc["totals"]
    cancelled = "cancelled" in t
    head = Text(
        f"run {doc['run']}: {t['done']}/{t['total']} done, {t['running']} running, "
        f"{t['queued']} queued, {t['failed']} failed"
        + (f", {t['cancelled']} cancelled" if cancelled else "")
        + f" · {doc['tokens_per_s']:.0f} tok/s · ETA {_eta(doc['eta_s'])}",
        style="bold",
    )
    parts = Table(box=None, pad_edge=False)
    states = ("running", "queued", "failed", "cancelled") if cancelled else ("running", "queued", "failed")
    for col in ("partition", "progress", "done", "total", *states):
        parts.add_column(col, justify="left" if col in ("partition", "progress") else "right")
    for name, c in sorted(doc["partitions"].items()):
        total = sum(n for state, n in c.items() if state != "quality")
        finished = total - c["queued"] - c["running"]
        parts.add_row(
            name,
            ProgressBar(total=max(total, 1), completed=finished, width=30),
            str(c["done"]),
            str(total),
            *(str(c.get(state, 0)) for state in states),
        )
    items: list[Any] = [head]
    if doc.get("paused"):
        items.append(Text(_paused_line(doc["run"], doc["paused"]), style="bold red"))
    items.append(parts)
    items += [Text(line) for line in _quality_lines(doc)]
    if (doc.get("results") or {}).get("store"):
        items.append(Text(_sealed_line(doc["results"], t["done"])))
    if doc.get("dead_letters"):
        items.append(Text(_dead_letters_line(doc["dead_letters"]), style="yellow"))
    if doc["failures"]:
        fails = Table("failure class", "jobs", "latest message", box=None)
        for cls, n in sorted(doc["failures"].items()):
            fails.add_row(cls, str(n), (doc.get("failure_messages", {}).get(cls) or "")[:120])
        items.append(fails)
    if doc["servers"]:
        srv = Table("server", "state", "url", "KV usage", "running", "queued", "restarts", box=None)
        for s in doc["servers"]:
            live = s.get("live") or {}
            usage = live.get("token_usage")
            srv.add_row(
                s["name"],
                s["state"],
                s["url"],
                f"{usage:.0%}" if isinstance(usage, float) else "-",
                str(int(live["running_req"])) if "running_req" in live else "-",
                str(int(live["queue_req"])) if "queue_req" in live else "-",
                str(s["restarts"]),
            )
        items.append(srv)
    admission = {n: a for n, a in (doc.get("admission") or {}).items() if a.get("budget") or a.get("window")}
    if admission:
        adm = Table(
            "admission",
            "rule",
            "in flight / window",
            "server run / wait",
            "held / budget (tokens)",
            "short",
            "long",
            "refused",
            box=None,
        )
        for name, a in sorted(admission.items()):
            adm.add_row(
                name,
                str(a.get("rule", "-")),
                f"{a.get('n', 0)}/{a.get('window', '-')}",
                f"{a.get('srv_running', '-')}/{a.get('srv_waiting', '-')}",
                f"{a.get('total', 0)}/{a.get('budget', '-')}",
                f"{a.get('n:short', 0)}/{a.get('cap:short', '-')}",
                f"{a.get('n:long', 0)}/{a.get('cap:long', '-')}",
                str(a.get("refused", 0)),
            )
        items.append(adm)
        items.append(Text(_lengths_line(doc.get("lengths") or {})))
    return Group(*items)
