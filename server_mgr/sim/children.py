"""The sim's child processes: idle stand-ins for ``sglang::scheduler`` and ``sglang::detokenizer``.

SGLang's main process spawns its scheduler and detokenizer (titled with setproctitle; each asks
the kernel to SIGKILL it when its parent dies) and watches them with a thread that polls every
second. When one dies, the main process logs ``Subprocess <name> (pid=N) crashed with exit code
C. Triggering SIGQUIT for cleanup...``, waits 5 s "to let GPU activity settle" while /health
hangs, then kills the whole tree, itself included (contract §6.4; seen on SGLang 0.5.23). The
sim does the same with two idle children, so a supervisor sees the same process tree, the same
titles and the same death.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from server_mgr.sim.logs import SimLog

POLL_S = 1.0
# (name in the crash line, process title)
CHILDREN = (("scheduler_0", "sglang::scheduler"), ("detokenizer", "sglang::detokenizer"))
# PR_SET_PDEATHSIG (1) = SIGKILL (9), then sleep; exit at once if the parent is already gone.
_CHILD_CODE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(0)\n"
    "while True: signal.pause()\n"
)


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen[bytes]


def spawn() -> list[Child]:
    """Start the stand-in children; each shows its SGLang title as its command line."""
    parent = str(os.getpid())
    return [
        Child(name, subprocess.Popen([title, "-c", _CHILD_CODE, parent], executable=sys.executable))
        for name, title in CHILDREN
    ]


async def watch(children: list[Child], log: SimLog, on_death: asyncio.Event) -> None:
    """Poll the children; when one has died, log SGLang's lines and set ``on_death``."""
    while True:
        for child in children:
            code = child.proc.poll()
            if code is not None:
                log.error(
                    f"Subprocess {child.name} (pid={child.proc.pid}) crashed with exit code {code}. "
                    "Triggering SIGQUIT for cleanup..."
                )
                on_death.set()
                return
        await asyncio.sleep(POLL_S)


def kill(children: list[Child]) -> None:
    """SIGKILL and reap the children (SGLang 0.5.23's shutdown kills what is left of them)."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGKILL)
    for child in children:
        child.proc.wait()
