"""Fatal faults: SGLang's crash and startup-OOM log lines, then death as SGLang dies.

A scheduler failure makes the real main process SIGKILL itself (``kill_process_tree`` including
the parent, §6.4), so every fatal fault here ends with SIGKILL: the exit status is -9 / 137,
whichever cause. The server manager tells the causes apart by the log lines (§5.4).
"""

from __future__ import annotations

import math
import os
import signal
from typing import NoReturn

from server_mgr.sim.config import GPU_TOTAL_GB, SimConfig
from server_mgr.sim.logs import SimLog

_SGLANG = "/usr/local/lib/python3.12/dist-packages/sglang/srt"


def die(log: SimLog, *, launching: bool = False) -> NoReturn:
    """The main process's SIGQUIT handler: log, then SIGKILL itself; the kernel SIGKILLs the
    children (they asked for it with PR_SET_PDEATHSIG, as SGLang's do). SGLang 0.5.23 has two
    handlers with two lines: one while launching, one once serving."""
    if launching:
        log.error("Received sigquit from a child process. It usually means the child failed.")
    else:
        log.error("SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
    kill_tree(log)


def kill_tree(log: SimLog) -> NoReturn:
    """SGLang's ``kill_process_tree`` of its own process: logged, then SIGKILL."""
    pid = os.getpid()
    log.error(f"kill_process_tree called: parent_pid={pid}, include_parent=True, pid={pid}")
    log.stream.flush()
    os.kill(pid, signal.SIGKILL)
    raise SystemExit(137)  # not reached: SIGKILL cannot be caught


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
    die(log, launching=True)


def oom_too_low(cfg: SimConfig, log: SimLog) -> NoReturn:
    """``--mem-fraction-static`` below ``--sim-oom-below``: the weights leave no room for the KV
    pool (SGLang 0.5.23's line, seen on its CPU path; older versions say "Not enough memory")."""
    floor = cfg.oom_below or 0.0
    log.error(
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        f'  File "{_SGLANG}/mem_cache/kv_cache_configurator.py", line 3050, in _profile_available_bytes\n'
        "    raise ValueError(\n"
        "ValueError: Loaded weights leave no GPU memory for the KV cache under "
        f"--mem-fraction-static={cfg.mem_fraction_static}. Raise --mem-fraction-static above "
        f"{math.ceil(floor * 1000) / 1000:.3f} (minimum viable = 1 - available/pre = {floor:.4f}). "
        "If using speculative decoding, draft weights are now counted.",
        rank=True,
    )
    die(log, launching=True)
