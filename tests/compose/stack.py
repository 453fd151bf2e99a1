"""compose.yaml brought up for real: the project, its command line, and what the tests read.

The stack is the repository's compose.yaml with two of its override files: docker/compose.sim.yaml
(the server manager on the sim engine, no GPU) and docker/compose.redis-debian.yaml (Redis from
Debian's redis-server). Images are built from the debootstrap base image (tests/compose/engine.py)
and docker/wheelhouse (``make wheelhouse``), so no registry is needed but Debian's archive.

The project has its own name, secrets, free host ports and output folder, written to an env
file that replaces ``.env``; compose runs with a clean environment, so nothing of the caller's
shell leaks into the stack. Everything the tests talk to is on 127.0.0.1.
"""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import redis

from producer.status import run_status
from tests.chaos import running_jobs
from tests.compose import engine
from tests.procs import ROOT, wait_for
from tokenmill.local_redis import free_port

PROJECT = "tokenmill-test"
FILES = (
    ROOT / "compose.yaml",
    ROOT / "docker" / "compose.sim.yaml",
    ROOT / "docker" / "compose.redis-debian.yaml",
)
SERVICES = ("redis", "server", "worker-short", "worker-long", "sealer", "flower", "metrics", "api")
DEMO = ROOT / "tokenmill" / "data" / "demo"
# The user the producer runs as: not root and not the image's own, like a user's $(id -u).
PRODUCER_UID = 4242
# The sim's knobs in docker/server.sim.toml, which decide its output (tests/pipeline.expected_for).
SIM_MEAN_OUTPUT_TOKENS = 200


class ComposeError(AssertionError):
    """A compose or docker command failed; the message has its output."""


@dataclass
class Stack:
    """One compose project of this repository's compose.yaml."""

    workdir: Path
    compose: list[str]
    settings: dict[str, str]

    @classmethod
    def create(cls, workdir: Path) -> Stack:
        out = workdir / "prepared"
        out.mkdir()
        os.chown(out, PRODUCER_UID, PRODUCER_UID)
        base = engine.base_image()
        settings = {
            "REDIS_PASSWORD": secrets.token_hex(16),
            "FLOWER_BASIC_AUTH": f"tm:{secrets.token_hex(8)}",
            "API_KEYS": f"{secrets.token_hex(8)},{secrets.token_hex(8)}",
            "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(16),
            "TOKENMILL_MODEL": "qwen3-8b",
            "PYTHON_IMAGE": base,
            "BASE_IMAGE": base,
            "INSTALL_FROM": "wheelhouse",
            "REDIS_PORT": str(free_port()),
            "SERVER_PORT": str(free_port()),
            "FLOWER_PORT": str(free_port()),
            "METRICS_PORT": str(free_port()),
            "API_PORT": str(free_port()),
            "INPUT_DIR": str(DEMO),
            "INPUT_FILE": "B1.jsonl",
            "OUTPUT_DIR": str(out),
            "PRODUCER_USER": f"{PRODUCER_UID}:{PRODUCER_UID}",
            "RUN": "demo",
        }
        (workdir / "stack.env").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        return cls(workdir, engine.compose_command(), settings)

    # --- commands -------------------------------------------------------------------------------

    def argv(self, *args: str) -> list[str]:
        files = [arg for f in FILES for arg in ("-f", str(f))]
        env_file = str(self.workdir / "stack.env")
        return [*self.compose, "--project-name", PROJECT, "--env-file", env_file, *files, *args]

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``docker compose ARGS`` on this project; fails with its output unless ``check=False``."""
        return _run(self.argv(*args), timeout, check)

    def producer(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """A one-shot ``--profile producer run --rm producer [ARGS]`` (its default command without ARGS)."""
        return self.run("--profile", "producer", "run", "--rm", "-T", "producer", *args, timeout=timeout)

    def containers(self, service: str) -> list[str]:
        """The ids of ``service``'s running containers."""
        return self.run("ps", "-q", service).stdout.split()

    def all_containers(self) -> list[str]:
        return self.run("ps", "-q", "--all").stdout.split()

    def logs(self, tail: int = 60) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), check=False).stdout

    # --- what the tests read ----------------------------------------------------------------------

    def port(self, name: str) -> int:
        return int(self.settings[name])

    def client(self) -> redis.Redis:
        """The ledger, through Redis's published port (fails fast while Redis restarts)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port("REDIS_PORT"),
            password=self.settings["REDIS_PASSWORD"],
            socket_timeout=5,
            socket_connect_timeout=2,
        )

    def status(self, run: str) -> dict[str, Any]:
        with self.client() as client:
            return run_status(client, run)

    def wait_finished(self, run: str, jobs: int, timeout: float) -> dict[str, Any]:
        """Wait until every one of ``jobs`` jobs of ``run`` is done or failed."""

        def finished() -> dict[str, Any] | None:
            t = self.status(run)["totals"]
            return t if t["total"] == jobs and t["done"] + t["failed"] == jobs else None

        try:
            totals: dict[str, Any] = wait_for(
                finished, timeout, f"run {run}'s {jobs} jobs to finish", every=1
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None
        return totals

    def http(self, port_name: str, path: str, auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
        """GET ``path`` on a published port: (status, body); an HTTP error status is returned too."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port(port_name)}{path}")
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def hostname(self, container: str) -> str:
        return docker("inspect", "-f", "{{.Config.Hostname}}", container).stdout.strip()

    def exported(self) -> Path:
        return Path(self.settings["OUTPUT_DIR"])

    # --- lifecycle ------------------------------------------------------------------------------

    def up(self, *args: str, timeout: float = 600) -> None:
        """``up -d --wait``: every service running, and healthy where it has a healthcheck."""
        res = self.run("up", "-d", "--wait", "--no-build", *args, timeout=timeout, check=False)
        if res.returncode:
            raise ComposeError(
                f"`compose up` exited {res.returncode}:\n{res.stdout}{res.stderr}\n{self.logs()}"
            )

    def down(self, volumes: bool = False) -> None:
        self.run(
            "down", "--remove-orphans", "--timeout", "30", *(["--volumes"] if volumes else []), timeout=300
        )

    def teardown(self) -> list[str]:
        """Remove the project's containers, networks and volumes (the producer's too); returns what
        is left of it afterwards (nothing, unless removal failed)."""
        self.run("--profile", "producer", "down", "--remove-orphans", "--volumes", "--timeout", "10",
                 timeout=300, check=False)  # fmt: skip
        label = f"label=com.docker.compose.project={PROJECT}"
        # compose builds the shared image once per service; the copies it replaced are dangling
        docker("image", "prune", "--force", "--filter", label, check=False)
        left = []
        for kind in ("container", "network", "volume"):
            listing = ["ps", "-aq"] if kind == "container" else [kind, "ls", "-q"]
            left += [f"{kind} {x}" for x in docker(*listing, "--filter", label).stdout.split()]
        return left


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["docker", *args], timeout, check)


def _run(argv: list[str], timeout: float, check: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG")}
    res = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, check=False, cwd=ROOT
    )
    if check and res.returncode:
        raise ComposeError(f"`{' '.join(argv)}` exited {res.returncode}:\n{res.stdout}{res.stderr}")
    return res


def published_ports(container: str) -> list[str]:
    """``docker port``'s lines for a container: ``5555/tcp -> 127.0.0.1:49153``."""
    return [line for line in docker("port", container).stdout.splitlines() if line.strip()]


def workers_seen(client: redis.Redis, run: str) -> set[str]:
    """Hostnames that hold a running job of ``run`` now (the ledger's ``worker`` = host:pid)."""
    return {v.worker.rsplit(":", 1)[0] for v in running_jobs(client, run).values() if v.worker}


def watch_workers(client: redis.Redis, run: str, until: Iterable[str], timeout: float) -> set[str]:
    """Sample the run's running jobs until every hostname of ``until`` was seen holding one."""
    wanted, seen = set(until), set()
    deadline = time.monotonic() + timeout
    while not wanted <= seen and time.monotonic() < deadline:
        try:
            seen |= workers_seen(client, run)
        except redis.ConnectionError:
            pass
        time.sleep(0.1)
    return seen


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]
