"""What a run's outputs look like: finish reasons and lengths, counted as each job commits.

The commit (``commit.lua``) adds one to three fields of the run's outputs hash
(:meth:`tokenmill.keys.RunKeys.outputs`): ``finish:<reason>``, ``c<bin>`` for the completion's
length and ``r<bin>`` for its reasoning's, in the length bins of :mod:`tokenmill.lengths` (16
tokens wide below 128, then 8 per doubling). Reasoning tokens are counted when the server
reported them for the whole completion (SGLang's ``usage.reasoning_tokens``; not for a job that
continued a checkpoint, whose earlier tokens the server did not see). It also keeps each
partition's latest job ids (:meth:`~tokenmill.keys.RunKeys.recent`), which the dashboard's
sample viewer reads.

Before a result is committed its text is cut at its stop strings (:func:`cut_at_stop`), whatever
the server sent: a server may let one through (SGLang trims a step's text at the first stop
string of the request's list that the step completed, not at the first in the text; a stop
string across a continuation's checkpoint is not seen by SGLang at all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from tokenmill import keys
from tokenmill.lengths import bin_of, edge

if TYPE_CHECKING:
    from tokenmill.quick_redis import ReadClient

FINISH = "finish:"
COMPLETION, REASONING = "c", "r"
RECENT_KEPT = 20  # job ids kept in each partition's recent list


def reasoning_tokens(usage: Mapping[str, Any] | None) -> int | None:
    """The reasoning tokens a server's usage reports (SGLang: ``reasoning_tokens``, and from
    0.5.23 ``completion_tokens_details.reasoning_tokens``), or None when it says nothing."""
    if not usage:
        return None
    value = usage.get("reasoning_tokens")
    if value is None:
        value = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    return int(value) if value is not None else None


class StopCut(NamedTuple):
    """An output cut at its first stop string (``stop`` None: it holds none)."""

    content: str
    reasoning: str
    stop: str | None = None


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """``(end, stop)``: of the stop strings that occur in ``text``, the one whose first occurrence
    ends first (on a tie, the first in ``stops``), and where that occurrence ends; a server that
    matches stop strings as it writes stops there. None when none occurs (empty ones never do).
    Cut before ``end - len(stop)``, the text holds no stop string; cut at ``end``, only that one,
    at its very end."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop) if stop else -1
        if at >= 0 and (best is None or at + len(stop) < best[0]):
            best = (at + len(stop), stop)
    return best


def cut_at_stop(content: str, reasoning: str, stops: Sequence[str], keep: bool = False) -> StopCut:
    """The output (``content`` after ``reasoning``, as the model writes them) ended at its first
    stop string: that string and all after it are cut, or with ``keep`` (``no_stop_trim``) all
    after it. SGLang matches stop strings in everything it generates, reasoning included, so a
    stop string in the reasoning leaves no content."""
    hit = first_stop(reasoning, stops)
    if hit is not None:
        return StopCut("", reasoning[: hit[0] if keep else hit[0] - len(hit[1])], hit[1])
    hit = first_stop(content, stops)
    if hit is not None:
        return StopCut(content[: hit[0] if keep else hit[0] - len(hit[1])], reasoning, hit[1])
    return StopCut(content, reasoning)


def tokens_through(pieces: Sequence[str], text: str, end: int) -> int | None:
    """How many of the token texts ``pieces`` write ``text`` up to ``end`` (the last may reach past
    it); None when they do not spell ``text`` from its start (special tokens, a character split
    across tokens) or run out first."""
    written = 0
    for n, piece in enumerate(pieces, 1):
        if not text.startswith(piece, written):
            return None
        written += len(piece)
        if written >= end:
            return n
    return None


def commit_fields(result: Mapping[str, Any]) -> tuple[str, str, str]:
    """The outputs-hash fields a commit of ``result`` counts: its finish reason, its completion
    length's bin, and its reasoning length's bin (``""`` when unknown)."""
    usage = result.get("usage") or {}
    reasoning = usage.get("reasoning_tokens")
    return (
        FINISH + str(result.get("finish_reason") or "unknown"),
        f"{COMPLETION}{bin_of(int(usage.get('completion_tokens') or 0))}",
        f"{REASONING}{bin_of(int(reasoning))}" if reasoning is not None else "",
    )


def outputs_view(client: ReadClient, run: str) -> dict[str, Any]:
    """The run's outputs (for status): jobs counted, finish reasons, the truncated share (jobs
    that ended on ``max_tokens``), and the completion and reasoning length histograms as
    ``[lower edge, upper edge, jobs]`` rows over the bins from the shortest to the longest."""
    raw = client.hgetall(keys.RunKeys(run).outputs())
    finish: dict[str, int] = {}
    bins: dict[str, dict[int, int]] = {COMPLETION: {}, REASONING: {}}
    for f, v in raw.items():
        name, n = (f.decode() if isinstance(f, bytes) else f), int(v)
        if name.startswith(FINISH):
            finish[name[len(FINISH) :]] = n
        elif name[:1] in bins and name[1:].isdigit():
            bins[name[:1]][int(name[1:])] = n
    jobs = sum(finish.values())
    return {
        "jobs": jobs,
        "finish_reasons": dict(sorted(finish.items(), key=lambda kv: -kv[1])),
        "truncated_share": round(finish.get("length", 0) / jobs, 4) if jobs else None,
        "completion_tokens": histogram(bins[COMPLETION]),
        "reasoning_tokens": histogram(bins[REASONING]),
        "reasoning_counted": sum(bins[REASONING].values()),
    }


def histogram(counts: Mapping[int, int]) -> list[list[int]]:
    """``[lower edge, upper edge, n]`` for every bin from the lowest counted to the highest."""
    if not counts:
        return []
    return [[edge(b), edge(b + 1), counts.get(b, 0)] for b in range(min(counts), max(counts) + 1)]
