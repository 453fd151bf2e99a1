"""The README's quick start, run line by line as a user would from a fresh clone.

The lines are read from README.md itself. Two things differ from a user's machine: the Redis
URL and port 30000 are replaced by the test's own Redis and a free port (other test runs may
share the machine), and the commands run in a directory that holds only links to the
repository's files and its .venv, so the export lands in a scratch directory.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import redis

from tests.pipeline import read_export, wait_run_finished
from tests.procs import ROOT, Proc, http_status, wait_for
from tokenmill.local_redis import free_port

README_REDIS = "redis://127.0.0.1:6379/0"


def quick_start_lines() -> list[str]:
    """The command lines of the README's quick-start block."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md has no bash block under '## Quick start'"
    return [line for line in block.group(1).splitlines() if line.strip()]


def checkout(tmp_path: Path) -> Path:
    """A directory that looks like a fresh clone with `make install` done."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv", "prepared"):
            (clone / entry.name).symlink_to(entry)
    (clone / ".venv").symlink_to(Path(sys.executable).parent.parent)
    return clone


def start(argv: list[str], log: Path, env: dict[str, str], cwd: Path) -> Proc:
    with log.open("ab") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    return Proc(proc, log)


def test_the_readme_quick_start_runs_as_written(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    clone = checkout(tmp_path)
    port = str(free_port())
    venv_bin = clone / ".venv" / "bin"
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "160"}
    env.pop("TOKENMILL_REDIS_URL", None)
    env.pop("TOKENMILL_SERVER_URL", None)
    env["TOKENMILL_SEAL_AFTER_S"] = "2"  # seal the finished partitions within seconds, not a minute
    seen: list[str] = []

    for line in quick_start_lines():
        line = line.replace(README_REDIS, redis_url).replace("30000", port)
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        seen.append(argv[1] if argv[0] == "tokenmill" else argv[0])
        if argv[0] == "source":
            assert (clone / argv[1]).exists(), line
            continue
        if argv[0] == "export":
            name, _, value = argv[1].partition("=")
            env[name] = value
            continue
        background = argv[-1] == "&"
        argv = argv[:-1] if background else argv
        assert argv[0] == "tokenmill", f"unexpected quick-start line: {line}"
        if background:
            proc = start(argv, tmp_path / f"{len(seen)}.log", env, clone)
            procs.append(proc)
            if argv[1] == "server":
                wait_for(lambda: http_status(f"http://127.0.0.1:{port}/health") == 200, 60, "the sim")
            elif argv[1] == "seal":
                wait_for(lambda p=proc: "sealing into" in p.output() or not p.alive(), 60, "the sealer")
            else:
                wait_for(lambda p=proc: " ready." in p.output() or not p.alive(), 60, "a worker")
            assert proc.alive(), proc.output()
        elif "--watch" in argv:
            proc = start(argv, tmp_path / "watch.log", env, clone)
            procs.append(proc)
            doc = wait_run_finished(rclient, "synth", 180)
            end = "{0}/{0} done".format(doc["totals"]["total"])
            wait_for(lambda p=proc, e=end: e in p.output(), 30, "status to show the end")
            proc.signal(signal.SIGINT)  # what the comment says: Ctrl-C once every job is done
            assert proc.proc.wait(20) == 130
        else:
            res = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, f"{line}\n{res.stdout}\n{res.stderr}"

    # Every command the quick start names ran, and the export is what the README shows
    setup = ["source", "export", "export", "export", "server", "enqueue"]
    assert seen == [*setup, "worker", "worker", "seal", "status", "export"]
    # The sealer the quick start starts keeps its shards where the README says
    assert env["TOKENMILL_RESULTS_URL"] == "results"
    wait_for(lambda: any((clone / "results").rglob("*.parquet")), 120, "the sealer's first shard")
    exported = read_export(clone / "prepared")
    assert sorted(exported) == ["B1", "B2"]
    assert len(exported["B1"]) == 120 and len(exported["B2"]) == 80
    first = exported["B1"][0]
    assert first["id"] == "b1-0" and first["partition"] == "B1" and "topic" in first["metadata"]
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant"]
    assert set(first) == {"id", "partition", "messages", "finish_reason", "usage", "model", "metadata"}
    # and running the same enqueue again adds nothing and says so
    enqueue = next(line for line in quick_start_lines() if "tokenmill enqueue" in line)
    argv = shlex.split(enqueue.replace(README_REDIS, redis_url), comments=True)
    again = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=120)
    assert "0 new" in again.stdout and "nothing to add" in again.stdout, again.stdout
