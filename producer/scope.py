"""What an operator command acts on: a run that exists, and all or one of its partitions.

Both are checked against the ledger, and a name that is not there is an error that names it
and lists what there is.
"""

from __future__ import annotations

import redis

from tokenmill import keys
from tokenmill.errors import ConfigError
from tokenmill.ledger import Ledger
from tokenmill.replies import text

_LISTED = 20  # names shown in an error; the rest are counted


def existing_run(client: redis.Redis, run: str) -> Ledger:
    """The ledger of ``run``; :class:`ConfigError` naming it when this Redis has no such run."""
    keys.check_run(run)
    if not client.sismember(keys.runs(), run):
        names = sorted(text(x) for x in client.smembers(keys.runs()))
        raise ConfigError(f"--run {run!r}: no run of that name in this Redis ({_listing('runs', names)})")
    return Ledger(client, run)


def partitions(ledger: Ledger, partition: str | None) -> dict[str, dict[str, int]]:
    """``{partition: counts}`` of the run, or of ``partition`` alone (which must exist)."""
    counts = ledger.counts()
    if partition is None:
        return counts
    if partition not in counts:
        raise ConfigError(
            f"--partition {partition!r}: run {ledger.run!r} has no partition of that name "
            f"({_listing('partitions', sorted(counts))})"
        )
    return {partition: counts[partition]}


def _listing(what: str, names: list[str]) -> str:
    if not names:
        return f"it has no {what}"
    shown = ", ".join(names[:_LISTED])
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return f"its {what}: {shown}{more}"
