"""Reading an SGLang log: live figures from Prefill/Decode lines, by field name, and a file tail.

Field order differs between releases (contract §5.3), so a batch line is read as ``name: value``
pairs. Names map to the same vocabulary the ``/metrics`` reader uses (``running_req``,
``queue_req``, ``token_usage``, ``gen_throughput``, ...); unknown fields keep a slug of their name.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

_BATCH_RE = re.compile(r"\b(Prefill|Decode) batch(?: \[\d+\])?[,.] (?P<fields>.*)$")
_PAIR_RE = re.compile(r"^\s*(?P<name>[^:,]+?):\s*(?P<value>-?[0-9.]+(?:[eE][-+]?\d+)?|True|False)\s*$")
_RETRACT_RE = re.compile(r"#retracted_reqs:\s*(\d+)")
_CAPACITY_RE = re.compile(r"\bmax_total_num_tokens=(\d+)")
_CONTEXT_RE = re.compile(r"\bcontext_len=(\d+)")
_FRACTION_RE = re.compile(r"mem_fraction_static=([0-9.]+)")

# SGLang's field names -> the names published as live.<name>
FIELD_NAMES = {
    "#running-req": "running_req",
    "#queue-req": "queue_req",
    "token usage": "token_usage",
    "full token usage": "token_usage",
    "gen throughput (token/s)": "gen_throughput",
    "input throughput (token/s)": "input_throughput",
    "#token": "num_used_tokens",
    "#new-seq": "new_seq",
    "#new-token": "new_token",
    "#cached-token": "cached_token",
    "#pending-token": "pending_token",
    # whether the batch ran as a captured graph: "cuda graph" on GPUs, "cpu graph" on the CPU
    # (seen on SGLang 0.5.23), "npu graph" on NPUs
    "cuda graph": "graph",
    "cpu graph": "graph",
    "npu graph": "graph",
}


def parse_batch_line(line: str) -> tuple[str, dict[str, float]] | None:
    """``("prefill"|"decode", figures)`` for a batch line, else None."""
    match = _BATCH_RE.search(line)
    if not match:
        return None
    figures: dict[str, float] = {}
    for part in match["fields"].split(","):
        pair = _PAIR_RE.match(part)
        if pair:
            # a known name's published one, else a slug of it
            name = pair["name"].strip()
            name = FIELD_NAMES.get(name) or re.sub(r"[^a-z0-9]+", "_", name.lower().replace("(token/s)", ""))
            value = pair["value"]
            figures[name.strip("_")] = float(value == "True") if value in ("True", "False") else float(value)
    return match[1].lower(), figures


def capacity_line(line: str) -> tuple[int, int | None] | None:
    """``(max_total_num_tokens, context_len)`` from the scheduler's startup summary line."""
    match = _CAPACITY_RE.search(line)
    if not match:
        return None
    context = _CONTEXT_RE.search(line)
    return int(match[1]), int(context[1]) if context else None


def launch_fraction(log_text: str) -> float | None:
    """The ``mem_fraction_static`` SGLang resolved, from its ``server_args=`` or OOM lines."""
    match = _FRACTION_RE.search(log_text)
    return float(match[1]) if match else None


@dataclass(slots=True)
class LiveFigures:
    """Figures accumulated from log lines; ``retractions`` counts since the launch."""

    figures: dict[str, float] = field(default_factory=dict)
    retractions: int = 0
    decode_lines: int = 0
    changed: bool = False
    last_batch_at: float = 0.0  # time.monotonic() of the last batch line (0: none yet)

    def feed(self, line: str) -> None:
        batch = parse_batch_line(line)
        if batch:
            kind, figures = batch
            self.decode_lines += kind == "decode"
            self.last_batch_at = time.monotonic()
            self.figures.update(figures)
            self.changed = True
            return
        # a ``KV cache pool is full. Retract requests.`` line: how many it retracted
        match = _RETRACT_RE.search(line) if "Retract requests" in line else None
        if match and (count := int(match[1])):
            self.retractions += count
            self.figures["retractions"] = float(self.retractions)
            self.changed = True

    def merge_metrics(self, figures: dict[str, float]) -> None:
        """Take /metrics figures in; event counters only ever grow (the log may count first)."""
        counted = figures.pop("retractions", None)
        if counted is not None and counted > self.retractions:
            self.retractions = int(counted)
        self.figures.update(figures)
        if self.retractions or counted is not None:
            self.figures["retractions"] = float(self.retractions)
        self.changed = True

    def quiet_for(self) -> float:
        """Seconds since the last batch line (infinite when there was none)."""
        return time.monotonic() - self.last_batch_at if self.last_batch_at else float("inf")


class LogTail:
    """Reads the lines appended to a file since a given offset, 1 MiB at a time."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self._partial = b""

    def read_lines(self) -> list[str]:
        """Complete new lines (tqdm's ``\\r`` also ends a line)."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                data = fh.read(1 << 20)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = re.split(rb"\r\n|\n|\r", data)
        return [line.decode("utf-8", "replace") for line in lines]


def read_since(path: Path, offset: int, max_bytes: int = 512 * 1024) -> str:
    """The text appended to ``path`` after ``offset`` (its last ``max_bytes`` at most)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            end = fh.tell()
            fh.seek(max(offset, end - max_bytes))
            return fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
