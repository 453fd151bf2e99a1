"""Startup: the CPU one call of a read-only command costs (``tokenmill status``, ``runs``, ...),
start to exit, interpreter and imports included.

A script that polls ``tokenmill status --json`` pays this on every call, on the machine the
workers share. One private redis-server (AOF on) holds a run of the demo dataset (200 jobs in
two partitions); each command is run ``--rounds`` times, the commands interleaved round by round,
and its CPU (user + system, from ``wait4``) is the median over the rounds. A first round, not
counted, leaves each module's bytecode cached (``PYTHONDONTWRITEBYTECODE`` is dropped for the
commands), as an installed tokenmill has it. Two floors are measured
beside them: the interpreter alone, and the interpreter importing redis-py (which every command
that reads Redis needs).

``--against DIR`` also runs each tokenmill command from another copy of the source (``DIR`` holds
its ``tokenmill``, ``producer``, ``workers`` and ``server_mgr``, e.g. from ``git archive``), first
on ``PYTHONPATH``, right after the same command from this clone: before and after in one run.

    .venv/bin/python bench/startup.py                 # 20 rounds: ~1 min
    .venv/bin/python bench/startup.py --rounds 40
    mkdir /tmp/base && git archive BASE tokenmill producer workers server_mgr | tar -x -C /tmp/base
    .venv/bin/python bench/startup.py --against /tmp/base
"""

from __future__ import annotations

import argparse
import os
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
Variant = tuple[str, list[str], dict[str, str]]  # label, argv, environment
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
        ("tokenmill server status", [tm, "server", "status"]),
    ]


def variants(cmds: list[tuple[str, list[str]]], against: Path | None) -> list[Variant]:
    """(label, argv, environment) to run: each command from this clone, and with ``against``
    each tokenmill command from there too, right after it (both trees first on PYTHONPATH)."""
    if against is None:
        return [(label, argv, {}) for label, argv in cmds]
    if not (against / "tokenmill" / "cli.py").is_file():
        raise SystemExit(f"--against {against}: no tokenmill/cli.py there")
    out: list[Variant] = []
    for label, argv in cmds:
        out.append((label, argv, {"PYTHONPATH": str(ROOT)}))
        if "tokenmill" in label:
            out.append((f"{label} [{against}]", argv, {"PYTHONPATH": str(against.resolve())}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=20, help="Runs of each command (default 20).")
    parser.add_argument(
        "--against", type=Path, default=None, help="Another copy of the source to measure beside this one."
    )
    args = parser.parse_args()
    exit_on_sigterm()
    print(machine())
    with workdir() as where, Children() as children:
        server = children.redis(where / "redis")
        env = {"TOKENMILL_REDIS_URL": server.url}
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's modules have their bytecode cached
        tm = str(Path(sys.executable).parent / "tokenmill")
        done = run_measured([tm, "enqueue", *map(str, DEMO), "--run", RUN], where / "enqueue.log", env)
        if done.returncode != 0:
            raise SystemExit(f"enqueue failed:\n{done.output}")
        cmds = variants(commands(), args.against)
        cpu: dict[str, list[float]] = {label: [] for label, _, _ in cmds}
        wall: dict[str, list[float]] = {label: [] for label, _, _ in cmds}
        others = wait_quiet()
        print(f"busy cores before the run: {others:.2f}")
        load = MachineLoad()
        for round_ in range(args.rounds + 1):
            for label, argv, extra in cmds:
                m = run_measured(argv, where / "cmd.log", {**env, **extra})
                if m.returncode != 0:
                    raise SystemExit(f"{label} exited {m.returncode}:\n{m.output}")
                if round_ == 0:  # the warm-up: bytecode written, files in the page cache
                    continue
                cpu[label].append(m.cpu_s)
                wall[label].append(m.wall_s)
        print(load.line())
    rows = [
        (label, f"{median(cpu[label]):.3f}", f"{min(cpu[label]):.3f}", f"{median(wall[label]):.3f}")
        for label, _, _ in cmds
    ]
    print(f"\n{args.rounds} rounds, medians (CPU is user + system of the process, from wait4):\n")
    print(table(("command", "CPU s (median)", "CPU s (min)", "wall s (median)"), rows))
    if args.against is not None:
        print(f"\nCPU of this clone's command / the same from {args.against}, median of per-round ratios:")
        for label, _, _ in cmds:
            other = cpu.get(f"{label} [{args.against}]")
            if other is not None:
                ratios = [a / b for a, b in zip(cpu[label], other, strict=True)]
                print(f"  {label}: {median(ratios):.2f}")


if __name__ == "__main__":
    main()
