"""``tokenmill server up``: one supervisor thread per configured server, signals, consumer gate.

The first SIGTERM or SIGINT drains and stops every server; a second one stops them without
waiting for in-flight requests. Returns 0 when every server was stopped, 1 if one failed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

import redis

from server_mgr.config import ServerConfig
from server_mgr.consumers import ConsumerGate
from server_mgr.reporting import RedisReporter, clear_stop_request
from server_mgr.supervisor import Supervisor
from tokenmill import servers
from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.server")

GATE_SYNC_S = 10.0
LOG_FORMAT = "[%(asctime)s] %(name)s %(levelname)s: %(message)s"


def setup_logging(log_dir: Path) -> None:
    """The manager's own log: stderr and ``<log_dir>/manager.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger("tokenmill")
    root.setLevel(logging.INFO)
    for handler in (logging.StreamHandler(), logging.FileHandler(log_dir / "manager.log")):
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)


def serve(
    configs: list[ServerConfig], client: redis.Redis, gate: ConsumerGate | None, settings: Settings
) -> int:
    """Supervise ``configs`` until they are all stopped or failed."""
    stop = threading.Event()
    changed = threading.Event()  # a state changed: the main thread syncs the gate (off the
    # supervisors' threads, since a pause asks the workers first)
    reporter = RedisReporter(client, settings.series_keep_s)
    supervisors = [Supervisor(c, reporter, stop_event=stop, on_change=changed.set) for c in configs]
    for c in configs:
        clear_stop_request(client, c.name)
    _install_signals(stop, supervisors)
    threads = [threading.Thread(target=s.run, name=f"supervise-{s.config.name}") for s in supervisors]
    for thread in threads:
        thread.start()
    next_sync = time.monotonic() + GATE_SYNC_S
    while any(t.is_alive() for t in threads):
        time.sleep(0.1)
        if gate is not None and (changed.is_set() or time.monotonic() >= next_sync):
            changed.clear()
            gate.sync()
            next_sync = time.monotonic() + GATE_SYNC_S
    if gate is not None:
        gate.sync()
    failed = [s for s in supervisors if s.record.state == servers.FAILED]
    for s in failed:
        log.error("[%s] failed: %s", s.config.name, s.record.last_error)
    return 1 if failed else 0


def _install_signals(stop: threading.Event, supervisors: list[Supervisor]) -> None:
    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            log.warning("second %s: stopping without draining", signal.Signals(signum).name)
            for s in supervisors:
                s.hurry.set()
            return
        log.warning("%s: draining and stopping every server", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
