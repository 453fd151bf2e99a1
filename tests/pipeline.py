"""Helpers for pipeline tests: datasets, running the CLI, waiting for a run, checking an export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import redis

from producer.status import run_status
from server_mgr.sim.textgen import expected_completion
from tests.procs import ROOT, wait_for

WORDS = ["alpha", "beta", "gamma", "δέλτα", "日本語", "emoji🙂", "naïve", "zeta"]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def mixed_rows(partition: str, n: int, long_every: int = 10) -> list[dict[str, Any]]:
    """``n`` rows mixing ``prompt`` and ``messages`` rows, unicode, some long prompts."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        text = f"{partition} question {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(i % 7 + 1))
        if long_every and i % long_every == 0:
            text += " long" * 400
        if i % 2:
            rows.append({"prompt": text, "topic": f"t{i % 3}"})
        else:
            rows.append(
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": text},
                    ],
                    "metadata": {"i": i},
                }
            )
    return rows


def cli(
    *args: str, env: dict[str, str], check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    import os

    res = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=ROOT,
        timeout=timeout,
    )
    if check and res.returncode != 0:
        raise AssertionError(
            f"tokenmill {' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}"
        )
    return res


def wait_run_finished(client: redis.Redis, run: str, timeout: float = 120) -> dict[str, Any]:
    def finished() -> dict[str, Any] | None:
        doc = run_status(client, run)
        t = doc["totals"]
        return doc if t["total"] and t["done"] + t["failed"] == t["total"] else None

    return wait_for(finished, timeout, f"run {run} to finish")


def read_export(out: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        p.stem: [orjson.loads(line) for line in p.read_bytes().splitlines()]
        for p in sorted(out.glob("*.jsonl"))
    }


def expected_for(row: dict[str, Any], *, max_tokens: int, reasoning: bool, mean_output_tokens: int) -> Any:
    """What the sim generates for an exported row's request (its input messages)."""
    return expected_completion(
        row["messages"][:-1],
        max_tokens=max_tokens,
        reasoning=reasoning,
        mean_output_tokens=mean_output_tokens,
    )


def without_nulls(value: object) -> object:
    """``value`` without null-valued keys at any depth: Arrow (a Dataset) fills a key some rows
    lack with null in the others; drop those to compare with an export's rows."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value
