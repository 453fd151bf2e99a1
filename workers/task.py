"""The Celery task ``tokenmill.generate(run, partition, job_id)`` and the worker's signal hooks."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import redis
from celery import Task
from celery.signals import celeryd_after_setup, worker_ready, worker_shutting_down

from tokenmill import redis_conn, worker_registry
from tokenmill.app import TASK_NAME, app
from tokenmill.app import settings as app_settings
from tokenmill.ledger import Ledger
from workers import celery_logs
from workers.job import ABANDON_AFTER_S, run_job
from workers.loadwatch import LoadWatch
from workers.runtime import current, get_runtime
from workers.upkeep import Upkeep

log = logging.getLogger("tokenmill.worker")
_upkeep: dict[str, Upkeep] = {}
_hostname: list[str] = [""]  # this worker's Celery name, once ready
STOP_SLACK_S = 15.0  # past the grace and the jobs' last wait: Celery's own stop (acks, consumer)


@app.task(name=TASK_NAME, bind=True, ignore_result=True, acks_late=True)
def generate(self: Task[Any, Any], run: str, partition: str, job_id: str) -> str:
    """Run one job of ``run``; duplicated deliveries and done jobs are no-ops."""
    rt = get_runtime(app_settings)
    outcome = run_job(rt, run, job_id)
    if outcome in ("skipped", "stopping"):
        # Not claimed: keep the job's message alive (acks_late acks this delivery on return).
        try:
            Ledger(rt.redis, run).republish([job_id])
        except redis.RedisError as exc:  # its waiting lease, else the reconciler, puts it back
            log.warning("job %s/%s: not republished (%s); the upkeep will put it back", run, job_id, exc)
        if rt.auth_error is not None:
            _stop_consuming(self)
    return outcome


def _stop_consuming(task: Task[Any, Any]) -> None:
    queue = (task.request.delivery_info or {}).get("routing_key")
    if queue and task.request.hostname:
        _unregister(task.request.hostname)  # or a server manager's resume would undo the stop
        task.app.control.cancel_consumer(queue, destination=[task.request.hostname])


@celeryd_after_setup.connect
def _on_after_setup(instance: Any = None, **_: Any) -> None:
    level = getattr(instance, "loglevel", logging.INFO)
    celery_logs.quiet_per_task(level if isinstance(level, int) else logging.getLevelName(str(level).upper()))


@worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    celery_logs.install()
    rt = get_runtime(app_settings)
    if sender is not None:  # (the consumer) its queues, for a server manager's resume
        _hostname[0] = sender.hostname
        try:
            worker_registry.register_worker(
                rt.redis, sender.hostname, list(sender.app.amqp.queues.consume_from)
            )
        except redis.RedisError as exc:
            log.warning("cannot register this worker's queues: %s", exc)
    loop = type(rt.loop.loop)
    log.info("streams run on one event loop: %s.%s", loop.__module__, loop.__qualname__)
    redis_conn.warn_durability(rt.redis)
    if "upkeep" not in _upkeep:
        _upkeep["upkeep"] = Upkeep(rt.redis, rt.settings)
        _upkeep["upkeep"].start()
        rt.reference.start()
        if rt.settings.admission and rt.settings.admission_closed_loop:
            LoadWatch(rt).start()


@worker_shutting_down.connect
def _on_shutting_down(**_: Any) -> None:
    rt = current()
    if rt is None:
        return
    rt.stopping.set()
    grace = rt.settings.shutdown_grace_s
    log.warning(
        "shutting down: in-flight streams get %.0fs to finish, then are checkpointed and released", grace
    )
    last_s = grace + ABANDON_AFTER_S + STOP_SLACK_S
    for timer in threading.Timer(grace, rt.abort_streams.set), threading.Timer(last_s, _stop_now, (last_s,)):
        timer.daemon = True
        timer.start()
    if "upkeep" in _upkeep:
        _upkeep["upkeep"].stop()
    if _hostname[0]:
        _unregister(_hostname[0])


def _unregister(worker: str) -> None:
    rt = current()
    if rt is None:
        return
    try:
        worker_registry.unregister_worker(rt.redis, worker)
    except redis.RedisError as exc:  # left behind: a resume sends it a harmless add_consumer
        log.warning("cannot unregister this worker's queues: %s", exc)


def _stop_now(after_s: float) -> None:
    """The warm shutdown's last resort: Celery acks each finished message on its way out, and
    against a broker host that vanished every ack waits out its connection's deadline (~10 s
    each). An unacked message is harmless (its job is done or leased in the ledger, and a
    redelivery is a no-op), so the worker exits instead of waiting for them all."""
    log.error(
        "shutdown still not done %.0fs after SIGTERM (is the broker unreachable?): exiting now; "
        "unacknowledged messages are redelivered and their jobs' ledger states make them no-ops",
        after_s,
    )
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
