"""`tokenmill demo` runs the whole pipeline on a machine with nothing running, and cleans up."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import orjson

from tests.procs import wait_for

DASHBOARD = re.compile(r"dashboard (http://127\.0\.0\.1:\d+)/\?run=demo")


def _get_json(url: str) -> dict[str, object] | None:
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc: dict[str, object] = orjson.loads(resp.read())
        return doc


def _session_members(sid: int) -> dict[int, str]:
    """Live (non-zombie) processes in session ``sid``: pid -> command line, read from /proc."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # exited while we looked
            continue
        # Fields after the command name (in parentheses): state, ppid, pgrp, session, ...
        state, _ppid, _pgrp, session = stat.rpartition(")")[2].split()[:4]
        if int(session) == sid and state != "Z":
            found[int(pid)] = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return found


def test_demo_exports_both_partitions_and_leaves_nothing_running(tmp_path: Path) -> None:
    # Given the demo in a session of its own: everything it starts (and what those start) is in it
    out = tmp_path / "demo-out"
    log = tmp_path / "demo.log"
    with log.open("wb") as fh:
        demo = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "demo", "--out", str(out)],
            cwd=tmp_path,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "120", "TOKENMILL_DASHBOARD_BASIC_AUTH": ""},
            start_new_session=True,
        )
    try:
        # While it runs, the session holds its redis-server, its sim and both workers
        seen: dict[int, str] = {}

        def all_parts_seen() -> bool:
            seen.update(_session_members(demo.pid))
            commands = list(seen.values())
            return (
                any("redis-server" in c for c in commands)
                and any(" server sim " in c for c in commands)
                and sum(" worker --queue " in c for c in commands) == 2
                and any(" dashboard --port " in c for c in commands)
            )

        wait_for(lambda: all_parts_seen() or demo.poll() is not None, 120, "the demo's processes")
        assert all_parts_seen(), f"the demo's session never held all its parts: {seen}"
        # and it printed the dashboard's address, where the run can be seen while it lasts
        printed = lambda: DASHBOARD.search(log.read_text()) or demo.poll() is not None  # noqa: E731
        found = wait_for(printed, 60, "the dashboard's address")
        assert isinstance(found, re.Match), log.read_text()

        def whole_run_shown() -> bool:
            status = _get_json(f"{found[1]}/api/status?run=demo") or {}
            return status["totals"]["total"] == 200  # type: ignore[index]

        wait_for(whole_run_shown, 60, "the dashboard to show the demo's run")
        assert demo.wait(300) == 0, log.read_text()
    finally:
        if demo.poll() is None:  # it failed or hung: stop it and what it started (its own group)
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    stdout = log.read_text()

    # Then it exported both partitions
    assert "200 new" in stdout and f"Completions are in {out}" in stdout
    assert len(re.findall(r"127\.0\.0\.1:\d+", stdout)) >= 2, stdout  # redis and the sim, loopback only
    # and sealed every result into shards before the export, which read them from there
    assert "sealed  200 of 200 done results" in stdout, stdout
    assert "200 rows read from sealed shards, 0 from Redis" in stdout, stdout
    rows = {p.stem: [orjson.loads(x) for x in p.read_bytes().splitlines()] for p in out.glob("*.jsonl")}
    assert sorted(rows) == ["B1", "B2"] and len(rows["B1"]) == 120 and len(rows["B2"]) == 80
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in rows["B1"])
    assert all(r["messages"][-1].get("reasoning_content") for r in rows["B2"])

    # and nothing it started outlives it
    left = _session_members(demo.pid)
    for pid in left:  # the test fails below; the leftovers must not outlive it either
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"the demo left processes running: {left}"
