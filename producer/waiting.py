"""``Client.wait``: poll a run's status until no job is queued or running, with a progress bar
where a terminal or a notebook shows one (rich, as ``tokenmill status --watch``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenmill.errors import WaitTimeoutError

if TYPE_CHECKING:
    from rich.progress import Progress

    from producer.documents import Status


def wait_run(
    read: Callable[[], Status], *, progress: bool, timeout_s: float | None, interval_s: float
) -> Status:
    """The run's final status, read every ``interval_s`` (or its status once it is paused with
    no job running: nothing more would move); :class:`WaitTimeoutError` after ``timeout_s``
    (None: no limit)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    status = read()
    bar = _bar(status) if progress else None
    try:
        while not status.finished and not (status.paused and status.totals["running"] == 0):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeoutError(
                    f"run {status.run}: not finished after {timeout_s:g} s ({_counts(status)})", status
                )
            time.sleep(interval_s if left is None else min(interval_s, left))
            status = read()
            if bar is not None:
                bar.update(bar.task_ids[0], **_fields(status))
    finally:
        if bar is not None:
            bar.stop()
    return status


def _counts(status: Status) -> str:
    t = status.totals
    text = f"{t['done']}/{t['total']} done, {t['running']} running, {t['queued']} queued"
    text += f", {t['failed']} failed"
    return text + (f", {t['cancelled']} cancelled" if t.get("cancelled") else "")


def _bar(status: Status) -> Progress | None:
    """A rich progress bar on stderr for the run, jobs ended (done, failed, cancelled) of all, if
    a terminal or a notebook shows it (else None: logs get no bar)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not (console.is_terminal or console.is_jupyter):
        return None
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[failed]} failed · {task.fields[rate]} tok/s · ETA {task.fields[eta]}"),
        TimeElapsedColumn(),
        console=console,
    )
    progress.add_task(f"run {status.run}", **_fields(status))
    progress.start()
    return progress


def _fields(status: Status) -> dict[str, Any]:
    t = status.totals
    eta = status.eta_s
    return {
        "completed": t["done"] + t["failed"] + t.get("cancelled", 0),
        "total": t["total"],
        "failed": t["failed"],
        "rate": f"{status.tokens_per_s:,.0f}",
        "eta": "?" if eta is None else f"{int(eta) // 60}m{int(eta) % 60:02d}s",
    }
