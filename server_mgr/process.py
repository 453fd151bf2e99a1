"""Server processes: launch in a new process group, stop, and make sure nothing of them is left.

SGLang's schedulers can outlive the launcher and keep the GPU (contract §6.6), so a stop is:
SIGTERM to the main PID (SGLang's graceful drain), then after a grace period SIGKILL to the whole
process group, then a check that no member of the group (nor a recorded descendant) is alive and,
where ``nvidia-smi`` exists, that none of them still holds GPU memory.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("tokenmill.server.process")

PROC = Path("/proc")


@dataclass(slots=True)
class Engine:
    """One launched server process (the leader of its own process group)."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    log_offset: int
    started_at: float
    seen: dict[int, int] = field(default_factory=dict)  # pid -> start time (clock ticks)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session makes the child its group's leader

    def returncode(self) -> int | None:
        """The exit status once the main process has exited, else None."""
        return self.proc.poll()

    def remember_members(self) -> None:
        """Record every process of the group and tree now (checked again after a stop)."""
        for pid, start in _members(self.pid).items():
            self.seen.setdefault(pid, start)


def launch(argv: list[str], env: Mapping[str, str], log_path: Path, banner: str) -> Engine:
    """Start ``argv`` in a new session, stdout and stderr appended to ``log_path``.

    Raises OSError when the program cannot be started (e.g. the launcher is not installed).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as fh:
        fh.write(banner.encode() + b"\n")
        fh.flush()
        offset = fh.tell()
        proc = subprocess.Popen(
            argv,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    engine = Engine(proc=proc, log_path=log_path, log_offset=offset, started_at=time.time())
    engine.remember_members()
    return engine


def stop(engine: Engine, grace_s: float, *, graceful: bool = True) -> int | None:
    """Stop the server: SIGTERM to the main PID, wait ``grace_s``, SIGKILL the group; reap.

    With ``graceful=False`` (a crash or a wedged server) the group is killed at once.
    Returns the main process's exit status.
    """
    if graceful and engine.returncode() is None:
        _signal(os.kill, engine.pid, signal.SIGTERM)
        _wait_exit(engine.proc, grace_s)
    engine.remember_members()
    _signal(os.killpg, engine.pgid, signal.SIGKILL)
    _wait_exit(engine.proc, 10.0)
    return engine.returncode()


def ensure_gone(pgid: int, seen: Mapping[int, int], timeout_s: float = 15.0) -> list[str]:
    """Wait until the group is empty, the ``seen`` processes are gone and none holds the GPU.

    ``seen`` maps pid -> start time, so a recycled pid is never mistaken for ours. Stragglers are
    SIGKILLed. Returns what is still there (empty when it is safe to relaunch).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        ours = [p for p, start in seen.items() if is_alive(p, start)]
        left = sorted(set(group_members(pgid)) | set(ours))
        holders = gpu_holders(ours)
        if not left and not holders:
            return []
        if time.monotonic() >= deadline:
            return [f"pid {p} still alive" for p in left] + [
                f"pid {p} still holds GPU memory" for p in holders
            ]
        for pid in left:
            _signal(os.kill, pid, signal.SIGKILL)
        _signal(os.killpg, pgid, signal.SIGKILL)
        time.sleep(0.1)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    return [pid for pid, st in _proc_table().items() if st.pgrp == pgid and st.state != "Z"]


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (they may have left its process group)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for child, st in table.items():
        children.setdefault(st.ppid, []).append(child)
    found: list[int] = []
    stack = list(children.get(pid, []))
    while stack:
        child = stack.pop()
        if table[child].state != "Z":
            found.append(child)
        stack.extend(children.get(child, []))
    return found


def is_alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``start``, is the process that started then."""
    stat = _read_stat(pid)
    return stat is not None and stat.state != "Z" and (start is None or stat.start == start)


def gpu_holders(pids: Iterable[int], run: Callable[..., str] | None = None) -> list[int]:
    """Those of ``pids`` that ``nvidia-smi`` lists as holding GPU memory ([] without nvidia-smi)."""
    if run is None and shutil.which("nvidia-smi") is None:
        return []
    run = run or _nvidia_smi
    try:
        out = run("--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader")
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s): cannot check that the GPU was released", exc)
        return []
    holding = {int(row.split(",")[0]) for row in out.splitlines() if row.split(",")[0].strip().isdigit()}
    return sorted(holding & set(pids))


def port_in_use(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def is_stale_server(pid: int, port: int) -> bool:
    """Whether ``pid`` is a group leader whose command line serves ``--port port`` (an orphan)."""
    stat = _read_stat(pid)
    if stat is None or stat.state == "Z" or stat.pgrp != pid:
        return False
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a == b"--port" and b == str(port).encode() for a, b in itertools.pairwise(argv))


def stop_orphan(pid: int, grace_s: float) -> list[str]:
    """Stop a server left by an earlier manager (not our child): SIGTERM, grace, SIGKILL group."""
    seen = _members(pid)
    _signal(os.kill, pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(os.killpg, pid, signal.SIGKILL)
    return ensure_gone(pid, seen)


def _nvidia_smi(*args: str) -> str:
    return subprocess.run(
        ["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=True
    ).stdout


def _proc_table() -> dict[int, _Stat]:
    stats = {int(entry.name): _read_stat(int(entry.name)) for entry in PROC.iterdir() if entry.name.isdigit()}
    return {pid: stat for pid, stat in stats.items() if stat is not None}


def _members(pid: int) -> dict[int, int]:
    """pid -> start time of ``pid``, of its process group (it leads one) and of its descendants."""
    return {p: st.start for p in {pid, *group_members(pid), *descendants(pid)} if (st := _read_stat(p))}


class _Stat(NamedTuple):
    state: str
    ppid: int
    pgrp: int
    start: int


def _read_stat(pid: int) -> _Stat | None:
    """State, parent, group and start time from /proc/<pid>/stat; None if the process is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return _Stat(fields[0], int(fields[1]), int(fields[2]), int(fields[19]))


def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)


def _signal(kill: Callable[[int, int], None], target: int, sig: signal.Signals) -> None:
    """``kill`` (os.kill or os.killpg) ``target``; one already gone or not ours is ignored."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        kill(target, sig)
