"""Startup: the CPU one call of a read-only command costs (``tokenmill status``, ``runs``, ...),
start to exit, interpreter and imports included.

A script that polls ``tokenmill status --json`` pays this on every call, on the machine the
workers share. One private redis-server (AOF on) holds a run of the demo dataset (200 jobs in
two partitions); each command is run ``--rounds`` times, the commands interleaved round by round,
and its CPU (user + system, from ``wait4``) is the median over the rounds. Two floors are measured
beside them: the interpreter alone, and the interpreter importing redis-py (which every command
that reads Redis needs).

    .venv/bin/python bench/startup.py                 # 20 rounds: ~1 min
    .venv/bin/python bench/startup.py --rounds 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import (
    ROOT,
    Children,
    MachineLoad,
    exit_on_sigterm,
    machine,
    median,
    run_measured,
    table,
    wait_quiet,
    workdir,
)

RUN = "startup"
DEMO = [ROOT / "tokenmill" / "data" / "demo" / f"{name}.jsonl" for name in ("B1", "B2")]


def commands() -> list[tuple[str, list[str]]]:
    """(label, argv) of each measured command; the console script, as a user runs it."""
    tm = str(Path(sys.executable).parent / "tokenmill")
    py = sys.executable
    return [
        ("python -c pass (floor)", [py, "-c", "pass"]),
        ("python -c 'import redis' (redis-py's floor)", [py, "-c", "import redis"]),
        ("python -c 'import tokenmill'", [py, "-c", "import tokenmill"]),
        ("tokenmill --help", [tm, "--help"]),
        (f"tokenmill status --run {RUN} --json", [tm, "status", "--run", RUN, "--json"]),
        (f"tokenmill status --run {RUN}", [tm, "status", "--run", RUN]),
        ("tokenmill runs --json", [tm, "runs", "--json"]),
        ("tokenmill runs", [tm, "runs"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20, help="Runs of each command (default 20).")
    args = parser.parse_args()
    exit_on_sigterm()
    print(machine())
    with workdir() as where, Children() as children:
        server = children.redis(where / "redis")
        env = {"TOKENMILL_REDIS_URL": server.url}
        tm = str(Path(sys.executable).parent / "tokenmill")
        done = run_measured([tm, "enqueue", *map(str, DEMO), "--run", RUN], where / "enqueue.log", env)
        if done.returncode != 0:
            raise SystemExit(f"enqueue failed:\n{done.output}")
        cmds = commands()
        cpu: dict[str, list[float]] = {label: [] for label, _ in cmds}
        wall: dict[str, list[float]] = {label: [] for label, _ in cmds}
        others = wait_quiet()
        print(f"busy cores before the run: {others:.2f}")
        load = MachineLoad()
        for _ in range(args.rounds):
            for label, argv in cmds:
                m = run_measured(argv, where / "cmd.log", env)
                if m.returncode != 0:
                    raise SystemExit(f"{label} exited {m.returncode}:\n{m.output}")
                cpu[label].append(m.cpu_s)
                wall[label].append(m.wall_s)
        print(load.line())
    rows = [
        (label, f"{median(cpu[label]):.3f}", f"{min(cpu[label]):.3f}", f"{median(wall[label]):.3f}")
        for label, _ in cmds
    ]
    print(f"\n{args.rounds} rounds, medians (CPU is user + system of the process, from wait4):\n")
    print(table(("command", "CPU s (median)", "CPU s (min)", "wall s (median)"), rows))


if __name__ == "__main__":
    main()
