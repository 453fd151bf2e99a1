"""sglang-router in front of engines: the Rust load balancer SGLang ships (0.3.2, installed in the
real-SGLang test environment), launched as a user would, on loopback, with its own process group.

The router answers ``/health`` 200 before it has registered any worker (registration runs in the
background: seen on 0.3.2), and answers a completion with 503 until one is registered, so
:func:`start_router` waits until ``/workers`` lists the workers it was asked to wait for as
healthy. Its Prometheus exporter binds to loopback on a free port (its default is 29000).
"""

from __future__ import annotations

import os
import signal
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from server_mgr import process
from tests.engines import sglang_env
from tests.procs import free_port, wait_for

ROUTER_READY_S = 120.0  # ~7 s on an idle machine (the two workers registered)
HEALTH_CHECK_S = 5  # how often the router checks its workers (its default, 60 s, x 3 failures)


@dataclass
class Router:
    url: str
    port: int
    proc: process.Engine
    api_key: str | None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str) -> bytes:
        request = urllib.request.Request(self.url + path, headers=self.headers())
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.read()

    def healthy_workers(self) -> set[str]:
        """The worker URLs the router lists as healthy (empty when it does not answer)."""
        try:
            listed = orjson.loads(self.get("/workers"))["workers"]
        except (OSError, ValueError, KeyError):
            return set()
        return {w["url"] for w in listed if w.get("is_healthy")}

    def kill(self) -> None:
        """SIGKILL the router's whole process group (no goodbye to open connections)."""
        os.killpg(self.proc.pgid, signal.SIGKILL)

    def stop(self) -> None:
        self.proc.remember_members()
        process.stop(self.proc, 10.0)
        left = process.ensure_gone(self.proc.pgid, self.proc.seen)
        assert not left, f"the router left processes behind: {left}"


def start_router(
    workdir: Path,
    workers: Sequence[str],
    *,
    policy: str = "cache_aware",
    api_key: str | None = None,
    port: int | None = None,
    wait_workers: Sequence[str] | None = None,
) -> Router:
    """Launch sglang-router in front of ``workers`` and wait until it routes to
    ``wait_workers`` (all of ``workers`` unless given)."""
    port = port or free_port()
    argv = [
        str(sglang_env().python),
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--health-check-interval-secs",
        str(HEALTH_CHECK_S),
        "--log-level",
        "warn",
    ]
    if api_key:
        argv += ["--api-key", api_key]
    proc = process.launch(
        argv, dict(os.environ), workdir / f"router-{port}.log", banner=f"# {' '.join(argv)}"
    )
    router = Router(f"http://127.0.0.1:{port}", port, proc, api_key)
    want = set(workers if wait_workers is None else wait_workers)

    def routing() -> bool:
        if proc.returncode() is not None:
            raise AssertionError(
                f"sglang-router exited {proc.returncode()}:\n{proc.log_path.read_text()[-3000:]}"
            )
        return want <= router.healthy_workers()

    try:
        wait_for(routing, ROUTER_READY_S, f"sglang-router on {router.url} to route to {sorted(want)}", 0.2)
    except BaseException:
        router.stop()
        raise
    return router


def router_status(router: Router, path: str) -> int:
    """The HTTP status of ``GET path`` on the router (with its key)."""
    try:
        router.get(path)
        return 200
    except urllib.error.HTTPError as exc:
        return exc.code
