"""Celery's floor: a worker with tokenmill's Celery configuration whose task does nothing.

The same app settings (``tokenmill.app.celery_config``: acks_late, prefetch 1, the orjson codec,
kombu's guards), the same queue, message and task name, the same command-line options as
``tokenmill worker`` and its per-task log lines quieted as there; the task returns at once. What
such a worker spends per message is what Celery and kombu cost a job before tokenmill does
anything (bench/jobcost.py --floor).

    python bench/noop_worker.py --queue short --concurrency 150 --hostname NAME --expect 1500
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
from typing import Any

from celery import Celery
from celery.signals import celeryd_after_setup

from tokenmill.app import TASK_NAME, celery_config
from tokenmill.settings import Settings
from workers import celery_logs

app = Celery("tokenmill-noop")
_ran = itertools.count(1)  # next() is atomic under the GIL
_expect: dict[str, int] = {}


@app.task(name=TASK_NAME, ignore_result=True, acks_late=True)
def generate(run: str, partition: str, job_id: str) -> str:
    """Nothing but counting: says so once the expected number of messages ran."""
    if next(_ran) == _expect.get("n"):
        print(f"noop worker: {_expect['n']} messages run", file=sys.stderr, flush=True)
    return "noop"


@celeryd_after_setup.connect
def _quiet(**_: Any) -> None:
    """As ``tokenmill worker``: no per-task INFO lines (workers/task.py)."""
    celery_logs.quiet_per_task(logging.INFO)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--queue", default="short")
    ap.add_argument("--concurrency", type=int, default=150)
    ap.add_argument("--hostname", default=f"noop-{os.getpid()}@%h")
    ap.add_argument("--expect", type=int, default=0, help="say when this many messages ran")
    a = ap.parse_args()
    _expect["n"] = a.expect
    app.conf.update(celery_config(Settings.load()))
    app.worker_main(
        ["worker", "-Q", a.queue, "-P", "threads", "-c", str(a.concurrency), "-l", "INFO",
         "-n", a.hostname, "--without-gossip", "--without-mingle"]
    )  # fmt: skip


if __name__ == "__main__":
    main()
