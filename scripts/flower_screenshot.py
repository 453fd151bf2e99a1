"""Screenshot Flower's tasks page while a run is in flight, with headless Chromium.

    .venv/bin/python scripts/flower_screenshot.py                  # private stack -> docs/flower.png
    .venv/bin/python scripts/flower_screenshot.py --url http://user:pass@127.0.0.1:5555/tasks

Without ``--url`` it starts what ``tokenmill demo`` starts (a private redis-server, the sim, a
short and a long worker) plus ``tokenmill flower`` with a throwaway password, enqueues the bundled
demo dataset, waits until some jobs are done and others still running, and shoots
``/tasks``. Every process it started is stopped on the way out.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
import redis

from tokenmill.ledger import Ledger
from tokenmill.local_redis import LocalRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
RUN = "demo"
USER = "tokenmill"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    # let the page's AJAX (the tasks table) finish before the shot is taken
    "--virtual-time-budget=8000",
]


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if value := cond():
                return value
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout_s}s waiting for {what}")


def get_json(url: str, password: str) -> Any:
    token = base64.b64encode(f"{USER}:{password}".encode()).decode()
    req = urllib.request.Request(url, headers={"Authorization": f"Basic {token}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return orjson.loads(resp.read())


class Stack(contextlib.ExitStack):
    """Child processes, stopped (SIGTERM, then SIGKILL) in reverse order on exit."""

    def __init__(self, workdir: Path) -> None:
        super().__init__()
        self.workdir = workdir

    def tokenmill(self, name: str, *args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                cwd=ROOT,
            )
        self.callback(_stop, proc)
        return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_stack(stack: Stack, password: str) -> tuple[str, redis.Redis, dict[str, str]]:
    """Redis, the sim, Flower and two workers; returns (Flower's base URL, client, env)."""
    rds = LocalRedis(stack.workdir / "redis").start()
    stack.callback(rds.stop)
    sim_port, flower_port = free_port(), free_port()
    sim_url, flower_url = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{flower_port}"
    env = {"TOKENMILL_REDIS_URL": rds.url, "TOKENMILL_SERVER_URL": sim_url}
    # slow enough that the shot catches jobs running beside jobs done
    stack.tokenmill(
        "sim",
        "server",
        "sim",
        "--port",
        str(sim_port),
        "--reasoning-parser",
        "qwen3",
        "--sim-mean-output-tokens",
        "160",
        "--sim-step-ms",
        "20",
        "--sim-health-latency-s",
        "0.05",
        env=env,
    )
    stack.tokenmill(
        "flower",
        "flower",
        "--port",
        str(flower_port),
        env={**env, "TOKENMILL_FLOWER_BASIC_AUTH": f"{USER}:{password}"},
    )
    wait_until(lambda: urllib.request.urlopen(f"{sim_url}/health", timeout=5).status == 200, 60, "the sim")
    wait_until(
        lambda: urllib.request.urlopen(f"{flower_url}/healthcheck", timeout=5).status == 200, 60, "Flower"
    )
    for queue, threads in (("short", "8"), ("long", "4")):
        stack.tokenmill(
            f"worker-{queue}",
            "worker",
            "--queue",
            queue,
            "--concurrency",
            threads,
            "--hostname",
            f"{queue}@tokenmill-demo",
            env=env,
        )
    # tasks only show up in Flower if it receives the workers' events: wait for their heartbeats
    wait_until(
        lambda: sum(get_json(f"{flower_url}/api/workers?status=true", password).values()) == 2,
        60,
        "Flower to see both workers",
    )
    return flower_url, redis.Redis.from_url(rds.url), env


def enqueue_demo(env: dict[str, str]) -> None:
    data = resources.files("tokenmill").joinpath("data/demo")
    files = [str(data.joinpath(f"{p}.jsonl")) for p in ("B1", "B2")]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "enqueue",
            *files,
            "--run",
            RUN,
            "--limit",
            "40",
            "--short-max-tokens",
            "512",
            "--long-max-tokens",
            "512",
            "--long-prompt-tokens",
            "16",
        ],
        env={**os.environ, **env},
        cwd=ROOT,
        check=True,
        capture_output=True,
    )


def screenshot(url: str, out: Path, size: str) -> None:
    """Shoot ``url`` with headless Chromium into ``out`` (PNG)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not browser:
        raise SystemExit("no chromium on PATH (Debian: apt-get install -y chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flower-shot-") as profile:
        subprocess.run(
            [
                browser,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={size}",
                f"--screenshot={out}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    if not out.exists() or out.stat().st_size == 0:
        raise SystemExit(f"chromium wrote no screenshot to {out}")


def shoot_private_stack(out: Path, size: str) -> None:
    password = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory(prefix="flower-stack-") as tmp, Stack(Path(tmp)) as stack:
        flower_url, client, env = start_stack(stack, password)
        enqueue_demo(env)
        ledger = Ledger(client, RUN)

        def mixed() -> bool:
            totals = {s: sum(c[s] for c in ledger.counts().values()) for s in ("done", "running")}
            return totals["done"] >= 12 and totals["running"] > 0

        wait_until(mixed, 120, "some jobs done while others run")
        port = flower_url.rsplit(":", 1)[1]
        screenshot(f"http://{USER}:{password}@127.0.0.1:{port}/tasks", out, size)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="Shoot this Flower page instead of starting a private stack.")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "flower.png")
    parser.add_argument("--window-size", default="1600,900", help="WIDTH,HEIGHT in pixels.")
    args = parser.parse_args()
    if args.url:
        screenshot(args.url, args.out, args.window_size)
    else:
        shoot_private_stack(args.out, args.window_size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
