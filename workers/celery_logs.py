"""Celery's broker-reconnect messages, told as they happen on the threads pool.

The reliability rules (docs/architecture.md) require
``worker_cancel_long_running_tasks_on_connection_loss``. When the broker connection drops,
Celery then warns for every running task that it is "Terminating it instead", tries to, and
logs a NotImplementedError traceback: a thread cannot be terminated. What happens in fact is
that the task keeps streaming and commits through the ledger, and the message Redis
redelivers for it later is a no-op. With 150 threads that was 300 misleading log entries and 150
tracebacks per reconnect; this filter leaves one accurate line per task.
"""

from __future__ import annotations

import logging

from celery.app import trace
from celery.worker import strategy
from celery.worker.consumer import consumer

CARRIES_ON = (
    "broker connection lost while task %s was running: a thread cannot be stopped, so it carries "
    "on; its result commits through the ledger and its redelivered message will be a no-op"
)
_CANCEL_FAILED = "Failed to cancel active request"


class ReconnectMessages(logging.Filter):
    """Rewrites Celery's per-task "Terminating it instead" and drops the traceback that follows."""

    def filter(self, record: logging.LogRecord) -> bool:
        # celery-types' stub of celery.worker.consumer.consumer leaves this module constant out
        if record.msg == consumer.TERMINATING_TASK_ON_RESTART_AFTER_A_CONNECTION_LOSS:  # type: ignore[attr-defined]
            record.msg = CARRIES_ON
            return True
        exc = record.exc_info[1] if record.exc_info else None
        cancel_failed = isinstance(record.msg, str) and record.msg.startswith(_CANCEL_FAILED)
        return not (cancel_failed and isinstance(exc, NotImplementedError))


# Per-job INFO lines: Celery's "Task ... received" and "Task ... succeeded in ...": two formatted
# log records per job, on the consumer and a task thread. The ledger already records every job's
# outcome.
PER_TASK_LOGGERS = (strategy.logger.name, trace.logger.name)


def quiet_per_task(loglevel: int) -> None:
    """Log the per-job lines only at DEBUG. Call before the consumer starts: Celery reads
    these loggers' levels once, when it builds each task's strategy and tracer."""
    level = logging.DEBUG if loglevel <= logging.DEBUG else logging.WARNING
    for name in PER_TASK_LOGGERS:
        logging.getLogger(name).setLevel(level)


def install() -> None:
    """Put the filter on Celery's consumer logger (once)."""
    logger = logging.getLogger(consumer.__name__)
    if not any(isinstance(f, ReconnectMessages) for f in logger.filters):
        logger.addFilter(ReconnectMessages())
