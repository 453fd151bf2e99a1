"""A run's pause and its quality stop rules: ``tokenmill pause`` (by hand), the rules a run stops
on (``enqueue --quality-stop``, else the ``quality_stop`` setting), stored in its rules hash,
and the pause lifted by ``tokenmill resume`` (:mod:`producer.resume`).

A rule trips inside the commit (``commit.lua``) and pauses the run as a person's pause does:
nothing more is claimed, running jobs finish, every job keeps its place in the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

from tokenmill import keys, quality_drift
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.quality import parse_rule
from tokenmill.replies import text


def encode_rules(exprs: Iterable[str]) -> dict[str, str]:
    """The rules hash's fields for ``exprs``, each checked (a :class:`~tokenmill.errors.ConfigError`
    names the first bad one): expression → ``op value min_jobs name``."""
    out = {}
    for expr in exprs:
        rule = parse_rule(expr)
        out[expr.strip()] = f"{rule.op} {rule.value!r} {rule.min_jobs} {rule.name}"
    return out


def store_rules(client: redis.Redis, run: str, given: dict[str, str], default: dict[str, str]) -> None:
    """Add ``given`` (the enqueue's ``--quality-stop``) to the run's rules; without any, the
    ``default`` (the setting's), when the run has no rules yet."""
    rules = keys.RunKeys(run).quality_rules()
    # the ignores: redis-py's hset takes a Mapping keyed by bytes | str | int | float, and a
    # Mapping's key type is invariant, so it refuses a dict[str, str]
    if given:
        client.hset(rules, mapping=given)  # type: ignore[arg-type]
    elif default and not client.exists(rules):
        client.hset(rules, mapping=default)  # type: ignore[arg-type]


def pause_run(ledger: Ledger, reason: str | None) -> tuple[bool, dict[str, str]]:
    """Pause the run by hand: whether it was paused now (else it already was), and the pause it
    is under (``reason``, ``at_ms``, ``by``)."""
    now = ledger.call(t.pause(ledger.k, reason or "paused by hand (tokenmill pause)", "person"))
    held = ledger.r.hgetall(ledger.k.paused())
    return now, {text(a): text(b) for a, b in held.items()}


def lift(ledger: Ledger) -> str:
    """Lift the run's pause and re-arm its rules (the windows cleared, and the reference's sums
    the ``drift`` rules judge): the reason lifted, '' when it was not paused."""
    reason = ledger.call(t.unpause(ledger.k, [text(p) for p in ledger.r.smembers(ledger.k.partitions())]))
    quality_drift.rearm(ledger.r, ledger.run)
    return reason
