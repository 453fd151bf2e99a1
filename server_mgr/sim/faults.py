"""Fatal faults: SGLang's crash and startup-OOM log lines, then death as SGLang dies.

A scheduler failure makes the real main process SIGKILL itself (``kill_process_tree`` including
the parent, §6.4), so every fatal fault here ends with SIGKILL: the exit status is -9 / 137,
whichever cause. The server manager tells the causes apart by the log lines (§5.4).
"""

from __future__ import annotations

import os
import signal
from typing import NoReturn

from server_mgr.sim.config import GPU_TOTAL_GB, SimConfig
from server_mgr.sim.logs import SimLog

_SGLANG = "/usr/local/lib/python3.12/dist-packages/sglang/srt"


def die(log: SimLog) -> NoReturn:
    """The main process's SIGQUIT path: log, then SIGKILL itself; the kernel SIGKILLs the
    children (they asked for it with PR_SET_PDEATHSIG, as SGLang's do)."""
    pid = os.getpid()
    log.error("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    log.error(f"kill_process_tree called: parent_pid={pid}, include_parent=True, pid={pid}")
    log.stream.flush()
    os.kill(pid, signal.SIGKILL)
    raise SystemExit(137)  # not reached: SIGKILL cannot be caught


def _scheduler_died(log: SimLog) -> None:
    log.error(
        "Rank 0 scheduler died during initialization (exit code: -9). If exit code is -9 "
        "(SIGKILL), a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check."
    )


def crash(log: SimLog) -> NoReturn:
    """A runtime scheduler crash (``--sim-crash-after-requests``, ``{"crash": true}``)."""
    log.error(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{_SGLANG}/managers/scheduler.py", line 3208, in run_scheduler_process\n'
        "    scheduler.event_loop_overlap()\n"
        f'  File "{_SGLANG}/managers/scheduler.py", line 1104, in event_loop_overlap\n'
        "    batch_result = self.run_batch(batch)\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.",
        rank=True,
    )
    die(log)


def oom_too_high(cfg: SimConfig, log: SimLog) -> NoReturn:
    """``--mem-fraction-static`` above ``--sim-oom-above``: CUDA-graph capture runs out of memory."""
    free = max(0.1, GPU_TOTAL_GB * (1 - cfg.mem_fraction_static) - 0.5)
    oom = (
        f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        f"{GPU_TOTAL_GB:.2f} GiB of which {free:.2f} GiB is free. Including non-PyTorch memory, "
        f"this process has {GPU_TOTAL_GB - free:.2f} GiB memory in use."
    )
    log.error(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{_SGLANG}/model_executor/cuda_graph_runner.py", line 412, in __init__\n'
        "    self.capture()\n"
        f"torch.OutOfMemoryError: {oom}\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n"
        f'  File "{_SGLANG}/managers/scheduler.py", line 3208, in run_scheduler_process\n'
        "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank)\n"
        f"Exception: Capture cuda graph failed: {oom}\n"
        "Possible solutions:\n"
        "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
        "2. set --cuda-graph-max-bs-decode to a smaller value (e.g., 16)\n"
        "3. disable CUDA graph by --cuda-graph-backend-decode=disabled. "
        "(Not recommended. Huge performance loss)\n"
        "Open an issue on GitHub https://github.com/sgl-project/sglang/issues/new/choose \n",
        rank=True,
    )
    _scheduler_died(log)
    die(log)


def oom_too_low(cfg: SimConfig, log: SimLog) -> NoReturn:
    """``--mem-fraction-static`` below ``--sim-oom-below``: no room left for the KV pool."""
    log.error(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{_SGLANG}/managers/scheduler.py", line 3208, in run_scheduler_process\n'
        "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, pp_rank, dp_rank)\n"
        f'  File "{_SGLANG}/model_executor/model_runner.py", line 1711, in init_memory_pool\n'
        "    raise RuntimeError(\n"
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. "
        f"Current value: mem_fraction_static={cfg.mem_fraction_static}\n",
        rank=True,
    )
    _scheduler_died(log)
    die(log)
