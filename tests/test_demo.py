"""`tokenmill demo` runs the whole pipeline on a machine with nothing running, and cleans up."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import orjson


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line or environment mentions ``text`` (root can read both)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for part in ("cmdline", "environ"):
            try:
                if text.encode() in Path(f"/proc/{pid}/{part}").read_bytes():
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def test_demo_exports_both_partitions_and_leaves_nothing_running(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    res = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "demo", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "120"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "200 new" in res.stdout and f"Completions are in {out}" in res.stdout
    # the sealer moved every result into shards before the export, which read them from there
    assert "sealed  200 of 200 done results" in res.stdout, res.stdout
    assert "200 rows read from sealed shards, 0 from Redis" in res.stdout, res.stdout
    rows = {p.stem: [orjson.loads(x) for x in p.read_bytes().splitlines()] for p in out.glob("*.jsonl")}
    assert sorted(rows) == ["B1", "B2"] and len(rows["B1"]) == 120 and len(rows["B2"]) == 80
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in rows["B1"])
    assert all(r["messages"][-1].get("reasoning_content") for r in rows["B2"])
    ports = re.findall(r"127\.0\.0\.1:(\d+)", res.stdout)
    assert len(ports) >= 2, res.stdout
    for port in ports:
        assert not _processes_mentioning(f"127.0.0.1:{port}"), f"the demo left a process on port {port}"
