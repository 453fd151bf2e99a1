"""What ``status`` shows of admission: a server's last decisions and a run's length curve.

Read-only, on a synchronous client, and light to import: ``tokenmill status`` reads these
without loading the limiter itself (:mod:`workers.admission.limiter`, which pulls in the event loop's
Redis client and the servers' metrics parser).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill import keys
from tokenmill.lengths import Survival, parse_counts
from tokenmill.replies import text as as_text

if TYPE_CHECKING:
    from tokenmill.quick_redis import ReadClient


def admission_view(client: ReadClient, server: str) -> dict[str, Any]:
    """The figures behind the last decisions on ``server`` (for status): numbers, and which
    ``rule`` decided (``window`` or ``budget``)."""
    raw = {as_text(f): as_text(v) for f, v in client.hgetall(keys.admission_used(server)).items()}
    out: dict[str, Any] = {name: _number(v) for name, v in raw.items() if not name.startswith("slot")}
    out["slots"] = int(client.zcard(keys.admission(server)))
    return out


def _number(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def read_survival(client: ReadClient, run: str) -> Survival:
    """The run's completion-length curve, from its lengths hash."""
    return Survival.from_counts(*parse_counts(client.hgetall(keys.RunKeys(run).lengths())))


def length_view(client: ReadClient, run: str) -> dict[str, Any]:
    """The run's completion-length curve behind the projections (for status)."""
    curve = read_survival(client, run)
    mean = curve.mean_known()
    return {
        "ended": curve.ended,
        "running": curve.running,
        "unknown_tail": round(curve.tail, 3),
        "p50": curve.quantile(0.5),
        "p90": curve.quantile(0.9),
        "mean_known": round(mean) if mean is not None else None,
    }
