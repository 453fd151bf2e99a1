"""What a run's quality looks like now, as status, the metrics and the history read it: the flags
counted since the run began, each partition's rates over its window of latest judged jobs, the
reference's drift, and the run's pause (O(partitions); importable without the transitions).

The commit (``commit.lua``) keeps the counts and the windows; :mod:`tokenmill.quality` says what
each flag means.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill import keys, quality_drift
from tokenmill.quality import DRIFT, RATE_NAMES

if TYPE_CHECKING:
    from tokenmill.quick_redis import ReadClient

JUDGED = "judged"


@dataclass(frozen=True, slots=True)
class QualityView:
    """``partitions``: each partition's ``status --json`` quality (``judged`` since the run
    began, ``window`` jobs the rates are over, ``since_resume`` jobs the rules' ``@N`` counts,
    each rate, None while the window is empty, and ``drift``/``drift_ci95``/``reference_error``
    with a reference);
    ``run``: the same over every partition (no drift); ``counts``: per partition, ``judged``
    and each flag's jobs since the run began; ``paused``: ``{"reason", "at", "by"}`` or None."""

    partitions: dict[str, dict[str, Any]]
    run: dict[str, Any]
    counts: dict[str, dict[str, int]]
    paused: dict[str, Any] | None


def _rates(window: int, flagged: dict[str, int]) -> dict[str, float | None]:
    return {
        rate: round(flagged.get(flag, 0) / window, 4) if window else None for rate, flag in RATE_NAMES.items()
    }


def quality_view(client: ReadClient, run: str, partitions: Iterable[str]) -> QualityView:
    k = keys.RunKeys(run)
    names = sorted(partitions)
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(k.quality())
    pipe.hgetall(k.quality_window_counts())
    pipe.hgetall(k.paused())
    for p in names:
        pipe.llen(k.quality_window(p))
    since, in_window, paused, *lengths = pipe.execute()
    counts = _by_partition(since)
    windows = _by_partition(in_window)
    drift = quality_drift.drift_view(client, run)
    docs: dict[str, dict[str, Any]] = {}
    total: dict[str, int] = {}
    for p, window in zip(names, map(int, lengths), strict=True):
        flagged = windows.get(p, {})
        doc: dict[str, Any] = {JUDGED: counts.get(p, {}).get(JUDGED, 0), "window": window}
        doc |= {"since_resume": flagged.get("n", 0), **_rates(window, flagged)}
        if p in drift:
            doc |= {DRIFT: drift[p]["drift"], f"{DRIFT}_ci95": drift[p]["ci95"]}
            doc["reference_error"] = drift[p]["error"]  # the reference's latest failure while it lasts
        docs[p] = doc
        for name, n in [(JUDGED, doc[JUDGED]), ("window", window), *flagged.items()]:
            total[name] = total.get(name, 0) + n
    run_doc: dict[str, Any] = {JUDGED: total.get(JUDGED, 0), "window": total.get("window", 0)}
    run_doc |= _rates(run_doc["window"], total)
    held = quality_drift.decode(paused)
    pause = None
    if held:
        at = int(held.get("at_ms") or 0) / 1000
        pause = {"reason": held.get("reason", ""), "at": at, "by": held.get("by")}
    return QualityView(docs, run_doc, counts, pause)


def _by_partition(raw: dict[Any, Any]) -> dict[str, dict[str, int]]:
    """A ``<partition>|<name>`` hash as ``{partition: {name: n}}`` (names are flags, ``judged``
    or ``n``)."""
    fields = quality_drift.per_partition(quality_drift.decode(raw))
    return {partition: {name: int(v) for name, v in f.items()} for partition, f in fields.items()}
