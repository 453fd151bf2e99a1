"""Build the real-SGLang test environment once per machine, outside the clone.

    python scripts/sglang_env/build.py [--home DIR]

DIR (default ``~/.cache/tokenmill/sglang-<version>``, or ``$TOKENMILL_SGLANG_HOME``) receives:

- ``venv/``: SGLang in a virtual environment of its own, as in production where tokenmill reaches
  it through the ``launcher`` setting (``venv/bin/python -m sglang.launch_server``);
- ``stubs/sgl_kernel``: the import-only stand-in (every attribute raises, naming itself);
- ``model/``: a tiny Qwen2-shaped model directory made here (tokenizer trained locally, random
  weights through ``--load-format dummy``); nothing is downloaded from a hub;
- ``.built``: the stamp, a hash of everything above's inputs. A second run with the same inputs
  returns at once, so fresh clones and CI reuse the environment; a changed input rebuilds.

A lock file makes concurrent builds (a session and a CI run on one machine) wait for each other.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

SGLANG_VERSION = "0.5.23"
HERE = Path(__file__).resolve().parent
INPUTS = (HERE / "requirements.txt", HERE / "make_model.py", HERE / "stubs" / "sgl_kernel" / "__init__.py")


def default_home() -> Path:
    env = os.environ.get("TOKENMILL_SGLANG_HOME")
    return Path(env) if env else Path.home() / ".cache" / "tokenmill" / f"sglang-{SGLANG_VERSION}"


def inputs_digest() -> str:
    h = hashlib.sha256(SGLANG_VERSION.encode())
    for path in INPUTS:
        h.update(path.read_bytes())
    return h.hexdigest()


def run(*args: str | Path, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(str(a) for a in args), flush=True)
    subprocess.run([str(a) for a in args], check=True, env=env)


def build(home: Path) -> None:
    python = home / "venv" / "bin" / "python"
    if not python.exists():
        venv.EnvBuilder(with_pip=True, clear=True).create(home / "venv")
        run(python, "-m", "pip", "install", "-q", "--upgrade", "pip")
    run(python, "-m", "pip", "install", "-q", "--no-deps", f"sglang=={SGLANG_VERSION}")
    run(python, "-m", "pip", "install", "-q", "-r", HERE / "requirements.txt")
    stubs = home / "stubs"
    shutil.rmtree(stubs, ignore_errors=True)
    shutil.copytree(HERE / "stubs", stubs, ignore=shutil.ignore_patterns("__pycache__"))
    run(python, HERE / "make_model.py", home / "model")
    # The serving stack must import with the stand-in first on the path.
    env = {**os.environ, "PYTHONPATH": str(stubs), "SGLANG_USE_CPU_ENGINE": "1"}
    run(python, "-c", "import sglang.srt.entrypoints.http_server", env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=default_home())
    args = parser.parse_args()
    home: Path = args.home.expanduser()
    home.mkdir(parents=True, exist_ok=True)
    stamp = home / ".built"
    digest = inputs_digest()
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text().strip() == digest:
            print(f"SGLang {SGLANG_VERSION} test environment up to date in {home}")
            return 0
        started = time.monotonic()
        stamp.unlink(missing_ok=True)
        build(home)
        stamp.write_text(digest + "\n")
        print(f"SGLang {SGLANG_VERSION} test environment built in {home} ({time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
