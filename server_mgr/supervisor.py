"""One server's life: launch, readiness, watch, restart with backoff, OOM steps, drain, stop.

``Supervisor.run`` blocks until the server is stopped (``down``) or given up on (``failed``).
Every action is reported to a :class:`~server_mgr.reporting.LogReporter` (Redis for ``server up``) and to
the manager's log. Stopping: set ``stop_event`` (signals) or leave a stop request in Redis
(``tokenmill server stop``); ``hurry`` skips the drain.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from server_mgr import health, logparse, process
from server_mgr.command import display_command, launch_argv, write_key_file
from server_mgr.config import ServerConfig
from server_mgr.crash import GIVE_UP, RESTART, Crash, classify, dooms_the_start
from server_mgr.policy import FAIL, RestartPolicy
from server_mgr.reporting import LogReporter
from tokenmill import capacity, server_report, servers
from tokenmill.servers import ServerRecord

log = logging.getLogger("tokenmill.server")

TICK_S = 0.1
STARTUP_PROBE_S = 0.5
STOP_POLL_S = 0.5
LIVE_PUBLISH_S = 1.0
HEARTBEAT_S = 5.0  # the record's updated_at is refreshed at least this often
LOG_QUIET_S = 10.0  # no batch line for this long: the log says nothing is in flight


class Supervisor:
    """Runs one server until it is stopped or given up on."""

    def __init__(
        self,
        config: ServerConfig,
        reporter: LogReporter,
        *,
        stop_event: threading.Event | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.reporter = reporter
        self.stop_event = stop_event or threading.Event()
        self.hurry = threading.Event()
        self.on_change = on_change or (lambda: None)
        self.policy = RestartPolicy(config)
        self.record = ServerRecord(
            name=config.name, url=config.public_url, state=servers.DOWN, engine=config.engine
        )
        self.changed = threading.Condition()
        self.live = logparse.LiveFigures()
        self._tail: logparse.LogTail | None = None
        self._doomed = False  # the log said the starting server will never serve (crash.dooms_the_start)
        self._engine: process.Engine | None = None
        self._launched_fraction: float | None = config.mem_fraction_static
        self._stop: dict[str, Any] | None = None
        self._next_stop_poll = 0.0
        self._last_report = 0.0
        self._probes = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"probe-{config.name}")

    # --- the loop ------------------------------------------------------------------------------

    def run(self) -> str:
        """Supervise until stopped (returns ``down``) or given up on (returns ``failed``)."""
        try:
            return self._run()
        except Exception as exc:  # a bug here must not leave the server running unsupervised
            log.exception("[%s] supervisor error", self.config.name)
            if self._engine is not None:
                process.stop(self._engine, self.config.stop_grace_s, graceful=False)
            return self._fail(f"supervisor error: {exc!r}")
        finally:
            self._probes.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> str:
        self._stop_orphan()
        while (crash := self._run_once()) is not None:
            decision = self.policy.decide(crash, time.time(), self._launched_fraction)
            if decision.action == FAIL:
                return self._fail(decision.reason)
            if decision.fraction is not None:
                self._event(
                    "oom_step",
                    decision.reason,
                    previous=self.config.mem_fraction_static,
                    fraction=decision.fraction,
                )
                self.config = replace(self.config, mem_fraction_static=decision.fraction)
            if self._sleep_unless_stopped(decision.delay_s):
                self._set_state(servers.DOWN)
                self._event("stopped", "server stopped (it was down, waiting to restart)")
                return servers.DOWN
            self.record.restarts += 1
            self._event(
                "restart",
                f"relaunch #{self.record.restarts} after {decision.reason}",
                delay_s=decision.delay_s,
            )
        self._set_state(servers.DOWN)
        self._event("stopped", "server stopped")
        return servers.DOWN

    def _run_once(self) -> Crash | None:
        """How one launch ended: a crash to remedy, or None when stopped on request (``_stop`` is set)."""
        crash = self._before_launch()
        if crash is not None or self._stop is not None:
            return crash
        try:
            engine = self._launch()
        except OSError as exc:
            argv0 = launch_argv(self.config)[0]
            return Crash("launch_failed", f"cannot start {argv0!r}: {exc}", GIVE_UP)
        crash = self._await_ready(engine)
        if crash is None and self._stop is None:
            self._on_ready(engine)
            crash = self._watch(engine)
        return self._shut_down(engine, crash)

    # --- launch and readiness ------------------------------------------------------------------

    def _before_launch(self) -> Crash | None:
        """Refuse to launch on a port something else holds (waits a little for a dying server)."""
        host = self.config.probe_host
        deadline = time.monotonic() + 5.0
        while process.port_in_use(host, self.config.port):
            if self._stop_wanted():
                return None
            if time.monotonic() >= deadline:
                return Crash("port_in_use", f"{host}:{self.config.port} is taken by another process", RESTART)
            time.sleep(0.2)
        return None

    def _launch(self) -> process.Engine:
        c = self.config
        key_file = write_key_file(c)
        shown = display_command(c, key_file=key_file)
        banner = f"===== tokenmill: launching {c.name} (restart {self.record.restarts}): {shown}"
        env = {**os.environ, **c.env}  # ours, plus the config's env table
        engine = process.launch(launch_argv(c, key_file=key_file), env, c.log_path, banner)
        self._engine = engine
        # The old figures read 0 until the new process logs its own (Redis keeps every field).
        self.live = logparse.LiveFigures(figures={k: 0.0 for k in self.record.live})
        self._tail = logparse.LogTail(c.log_path, engine.log_offset)
        self._doomed = False
        extra = {
            "command": shown,
            "log_path": str(c.log_path),
            "host": socket.gethostname(),
            "mem_fraction_static": c.mem_fraction_static,
        }
        self._set_state(
            servers.STARTING, pid=engine.pid, max_total_num_tokens=None, context_length=None, extra=extra
        )
        self._event("launch", f"pid {engine.pid}: {shown}", pid=engine.pid)
        return engine

    def _await_ready(self, engine: process.Engine) -> Crash | None:
        """None once ``/health`` answers 200 (or a stop is asked), else how the startup ended."""
        c = self.config
        deadline = time.monotonic() + c.startup_timeout_s
        probe: Future[str | None] | None = None
        next_probe = 0.0
        while True:
            self._read_log()
            code = engine.returncode()
            if code is not None or self._doomed:
                return self._classify(engine, code, first_prefill=True)
            if self._stop_wanted():
                return None
            if time.monotonic() >= deadline:
                why = f"not ready within startup_timeout_s = {c.startup_timeout_s:g}"
                return Crash("startup_timeout", why, RESTART)
            if probe is not None and probe.done():
                if probe.result() is None:
                    return None
                probe = None
            if probe is None and time.monotonic() >= next_probe:
                probe = self._probes.submit(health.probe_health, c.probe_url, c.health_timeout_s)
                next_probe = time.monotonic() + STARTUP_PROBE_S
                engine.remember_members()
            time.sleep(TICK_S)

    def _on_ready(self, engine: process.Engine) -> None:
        total, context = self._capacity(engine)
        self._set_state(servers.READY, max_total_num_tokens=total, context_length=context)
        self._event(
            "ready",
            f"up after {time.time() - engine.started_at:.1f} s: "
            f"max_total_num_tokens={total}, context_length={context}",
            max_total_num_tokens=total,
            context_length=context,
            mem_fraction_static=self.config.mem_fraction_static,
        )

    def _capacity(self, engine: process.Engine) -> tuple[int | None, int | None]:
        c = self.config
        try:
            return capacity.fetch(c.probe_url, c.api_key, c.health_timeout_s)
        except (OSError, ValueError) as exc:
            log.warning("[%s] /server_info failed (%s); capacity from the log", c.name, exc)
        lines = logparse.read_since(c.log_path, engine.log_offset).splitlines()
        return next(filter(None, map(logparse.capacity_line, lines)), (None, None))

    # --- watching a ready server ---------------------------------------------------------------

    def _watch(self, engine: process.Engine) -> Crash | None:
        """Watch the process and ``/health`` until it dies, wedges or is asked to stop (None)."""
        c = self.config
        failures = 0
        probe: Future[str | None] | None = None
        next_probe = time.monotonic() + c.health_interval_s
        while True:
            self._read_log()
            code = engine.returncode()
            if code is not None:
                return self._classify(engine, code, first_prefill=self.live.decode_lines == 0)
            if self._stop_wanted():
                self._drain(engine)
                return None
            if probe is not None and probe.done():
                error = probe.result()
                failures = 0 if error is None else failures + 1
                if failures:
                    log.warning("[%s] health probe failed (%d in a row): %s", c.name, failures, error)
                if failures >= c.health_failures:
                    why = f"{failures} /health probes failed in a row (last: {error})"
                    return Crash("health_failed", why, RESTART)
                probe = None
            if probe is None and time.monotonic() >= next_probe:
                probe = self._probes.submit(health.probe_health, c.probe_url, c.health_timeout_s)
                next_probe = time.monotonic() + c.health_interval_s
                self._periodic(engine)
            time.sleep(TICK_S)

    def _periodic(self, engine: process.Engine) -> None:
        """Each health interval: /metrics figures, the process tree, and a heartbeat."""
        c = self.config
        engine.remember_members()
        if c.enable_metrics:
            try:
                self.live.merge_metrics(server_report.metrics(c.probe_url, c.health_timeout_s))
            except (OSError, ValueError) as exc:
                log.debug("[%s] /metrics failed: %s", c.name, exc)
        self._report(force=True)

    def _read_log(self) -> None:
        if self._tail is not None:
            for line in self._tail.read_lines():
                self.live.feed(line)
                self._doomed = self._doomed or dooms_the_start(line)
        self._report()

    def _report(self, force: bool = False) -> None:
        """Publish new live figures (at most every LIVE_PUBLISH_S) and a heartbeat."""
        since = time.monotonic() - self._last_report
        if not (force or since >= HEARTBEAT_S or (self.live.changed and since >= LIVE_PUBLISH_S)):
            return
        self._last_report = time.monotonic()
        self.live.changed = False
        self.record.live = dict(self.live.figures)
        self.record.updated_at = time.time()
        self.reporter.publish(self.record)

    # --- stopping ------------------------------------------------------------------------------

    def _stop_orphan(self) -> None:
        """Stop a server this config left running on this host (its manager died)."""
        c = self.config
        pid = self.reporter.previous_pid(c.name)
        if pid is None or not process.is_stale_server(pid, c.port):
            return
        self._event("orphan", f"pid {pid} of an earlier run still serves port {c.port}; stopping it", pid=pid)
        left = process.stop_orphan(pid, c.stop_grace_s)
        if left:
            log.error("[%s] the earlier server is still there: %s", c.name, "; ".join(left))

    def _stop_wanted(self) -> bool:
        if self._stop is None and self.stop_event.is_set():
            self._stop = {"drain": True, "by": "signal"}
        if self._stop is None and time.monotonic() >= self._next_stop_poll:
            self._next_stop_poll = time.monotonic() + STOP_POLL_S
            self._stop = self.reporter.take_stop_request(self.config.name)
        if self._stop is not None and not self._stop.get("drain", True):
            self.hurry.set()
        return self._stop is not None

    def _drain(self, engine: process.Engine) -> None:
        """State ``draining`` (consumers pause), then wait up to drain_grace_s for in-flight work."""
        c = self.config
        self._set_state(servers.DRAINING)
        self._event(
            "drain",
            f"draining (up to {c.drain_grace_s:g} s), requested by "
            f"{self._stop.get('by', '?') if self._stop else '?'}",
        )
        deadline = time.monotonic() + c.drain_grace_s
        busy = self._in_flight()
        while busy and not self.hurry.is_set() and engine.returncode() is None:
            if time.monotonic() >= deadline:
                self._event(
                    "drain_timeout",
                    f"{busy} request(s) still in flight after {c.drain_grace_s:g} s; stopping anyway",
                )
                return
            time.sleep(max(TICK_S, 0.25))
            self._read_log()
            busy = self._in_flight()

    def _in_flight(self) -> int:
        """Running plus queued requests: from the server, else from the log's batch lines."""
        c = self.config
        count = server_report.in_flight(
            c.probe_url, c.api_key, min(c.health_timeout_s, 5.0), metrics_enabled=c.enable_metrics
        )
        if count is not None:
            return count
        if self.live.quiet_for() >= LOG_QUIET_S:  # an idle server logs no batch lines
            return 0
        return int(self.live.figures.get("running_req", 0) + self.live.figures.get("queue_req", 0))

    def _shut_down(self, engine: process.Engine, crash: Crash | None) -> Crash | None:
        """Stop what is left of the server and make sure none of it remains."""
        c = self.config
        if crash is not None:
            self._set_state(servers.DOWN, last_error=crash.describe())
            self._event("crash", crash.describe(), crash_class=crash.kind, returncode=crash.returncode)
        # A wedged server may still drain on SIGTERM; a dead one has nothing left to drain.
        graceful = crash is None or crash.kind == "health_failed"
        code = process.stop(engine, c.stop_grace_s, graceful=graceful and not self.hurry.is_set())
        left = process.ensure_gone(engine.pgid, engine.seen)
        self._engine = None
        if left:
            reason = f"processes of the old server remain after SIGKILL: {'; '.join(left)}"
            return Crash("not_released", reason, GIVE_UP, code)
        log.info("[%s] pid %d and its process group are gone (exit %s)", c.name, engine.pid, code)
        return crash

    def _sleep_unless_stopped(self, delay_s: float) -> bool:
        """Sleep ``delay_s``; True if a stop was asked meanwhile."""
        deadline = time.monotonic() + delay_s
        while time.monotonic() < deadline:
            if self._stop_wanted():
                return True
            self._report()
            time.sleep(TICK_S)
        return self._stop_wanted()

    # --- reporting -----------------------------------------------------------------------------

    def _classify(self, engine: process.Engine, code: int | None, *, first_prefill: bool) -> Crash:
        self._read_log()
        text = logparse.read_since(engine.log_path, engine.log_offset)
        if self.config.api_key:  # SGLang logs its options, the key among them: a crash's lines are shown
            text = text.replace(self.config.api_key, "***")
        # Unset in the config, the fraction SGLang resolved is in its log (for an OOM step).
        self._launched_fraction = self.config.mem_fraction_static or logparse.launch_fraction(text)
        return classify(text, code, first_prefill=first_prefill)

    def _fail(self, reason: str) -> str:
        log.error("[%s] giving up: %s", self.config.name, reason)
        self._set_state(servers.FAILED, last_error=reason)
        self._event("failed", reason)
        return servers.FAILED

    def _set_state(self, state: str, *, extra: dict[str, Any] | None = None, **changes: Any) -> None:
        previous = self.record.state
        for name, value in changes.items():
            setattr(self.record, name, value)
        self.record.state = state
        self.record.live = dict(self.live.figures)
        self.record.updated_at = time.time()
        self.reporter.publish(self.record, **(extra or {}))
        with self.changed:
            self.changed.notify_all()
        if state != previous:
            log.info("[%s] %s -> %s", self.config.name, previous, state)
            self.on_change()

    def _event(self, kind: str, message: str, **data: Any) -> None:
        self.reporter.event(self.config.name, kind, message, **data)

    def wait_for(self, states: tuple[str, ...], timeout_s: float) -> str:
        """Block until the state is one of ``states`` (or the timeout); returns the state."""
        with self.changed:
            self.changed.wait_for(lambda: self.record.state in states, timeout=timeout_s)
        return self.record.state
