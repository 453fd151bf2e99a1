"""The Celery app: queues ``short`` and ``long``, the orjson codec, the reliability settings.

``celery -A tokenmill.app worker -Q short -P threads -c 150`` works: the broker URL is read from
the settings object when Celery first configures the app (at start, not at import).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu import Exchange, Queue

from tokenmill import keys, kombu_patch, redis_conn, redis_url
from tokenmill.messages import TASK_NAME as TASK_NAME  # the task's name, re-exported
from tokenmill.serializer import NAME as SERIALIZER
from tokenmill.serializer import register_orjson
from tokenmill.settings import Settings

register_orjson()
kombu_patch.apply()

app = Celery("tokenmill", include=["workers.task"])
# kombu's Redis connections wait forever by default (socket_timeout None): a broker host that
# vanishes would hold a publish, an ack and the warm shutdown until the kernel gives up. These
# are redis-py's own defaults, and kombu's check of its long-lived BRPOP and pub/sub connections
# every 10 s (its 25 s default let a consumer on a dead connection sit ~51 s).
BROKER_DEADLINES = {**redis_conn.DEADLINES, "health_check_interval": 10}
_configured: dict[str, Settings] = {}


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery configuration the reliability rules call for (docs/architecture.md, section 4)."""
    # The longest task is bounded by total_timeout_s; redelivery after a worker dies is the
    # reaper's job (a lease TTL), so the broker's visibility timeout only has to exceed it.
    visibility_timeout = int(settings.total_timeout_s + 3600)
    return {
        "broker_url": redis_url.broker_url(settings.redis_url),
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": visibility_timeout,
            **BROKER_DEADLINES,
            **redis_url.broker_transport_options(settings.redis_url),
        },
        "broker_connection_timeout": BROKER_DEADLINES["socket_connect_timeout"],
        "task_queues": [Queue(q, Exchange(q, type="direct"), routing_key=q) for q in keys.QUEUES],
        "task_default_queue": "short",
        "task_default_exchange": "short",
        "task_default_routing_key": "short",
        "task_serializer": SERIALIZER,
        "accept_content": [SERIALIZER],
        "event_serializer": SERIALIZER,
        "result_accept_content": [SERIALIZER],
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_disable_rate_limits": True,  # no task has a rate limit: skip the per-message check
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # Off unless asked (settings.task_events): Flower turns them on in running workers itself.
        "worker_send_task_events": settings.task_events,
        "task_send_sent_event": False,
        "worker_hijack_root_logger": False,
        "broker_heartbeat": 0,
    }


def configure(settings: Settings) -> Celery:
    """Configure the app from ``settings`` (entry points call this once, before starting)."""
    _configured["settings"] = settings
    app.conf.update(celery_config(settings))
    return app


def settings() -> Settings:
    """The settings the app was configured with (built from the environment if nobody did)."""
    if "settings" not in _configured:
        configure(Settings.load())
    return _configured["settings"]


@app.on_configure.connect
def _on_configure(sender: Celery, **_: Any) -> None:
    sender.conf.update(celery_config(settings()))
