"""The two inference engines the tests run against: the sim, and real SGLang 0.5.23 on the CPU.

Both are launched with SGLang's own flag names, in a session of their own, and stopped the way
the server manager stops them (SIGTERM to the main PID, then SIGKILL to the group), so a test
leaves nothing running. The real engine comes from the environment ``make sglang-env`` builds
once per machine (``scripts/sglang_env/build.py``); when it is missing, the tests that need it
fail and say how to build it: they never skip.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from server_mgr import process
from server_mgr.crash import dooms_the_start
from tests.faultproxy import FaultProxy
from tests.procs import PortTaken, http_status, wait_for
from tokenmill.local_redis import free_port

ENGINES = ("sim", "sglang")
SGLANG_VERSION = "0.5.23"
API_KEY = "tm-test-key"
MAX_TOTAL_TOKENS = 20000
CONTEXT_LEN = 8192  # the tiny model's max_position_embeddings
STAND_IN_MARK = "sgl_kernel stand-in called:"
# SGLang's CPU path: torch attention and sampling, and an idle scheduler that sleeps instead of
# busy-polling a core. float32: in bfloat16, KV reused from the prefix cache (computed inside
# another request's prefill) differs in the last bits, and greedy outputs of 160 tokens were seen
# to part after ~100 tokens; the tests compare results with solo regenerations.
SGLANG_CPU_FLAGS = (
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--sleep-on-idle",
)
# No CUDA graphs, with the 0.5.23 flags, not the deprecated --disable-cuda-graph (what the server
# manager's `cuda_graphs = false` emits).
NO_GRAPH_FLAGS = ("--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled")
# The sim as the tiny model behaves: outputs run to max_tokens far more often than they stop,
# the model's context is 8192, and health and startup are quick.
SIM_FLAGS = (
    "--sim-model-context-length",
    str(CONTEXT_LEN),
    "--sim-mean-output-tokens",
    "2000",
    "--sim-startup-delay-s",
    "0.2",
    "--sim-warmup-s",
    "0.1",
    "--sim-health-latency-s",
    "0.05",
    "--sim-step-ms",
    "2",
    "--sim-crash-diagnostics-s",
    "1",
)
SGLANG_READY_S = 240.0  # ~20 s on an idle machine, several times that beside a busy test suite


@dataclass(frozen=True, slots=True)
class SglangEnv:
    """The SGLang virtual environment, the ``sgl_kernel`` stand-in and the tiny model."""

    home: Path

    @property
    def python(self) -> Path:
        return self.home / "venv" / "bin" / "python"

    @property
    def model(self) -> Path:
        return self.home / "model"

    @property
    def stubs(self) -> Path:
        return self.home / "stubs"

    def launcher(self) -> list[str]:
        return [str(self.python), "-m", "sglang.launch_server"]

    def env(self) -> dict[str, str]:
        """What SGLang needs on this machine: the stand-in first on the path, the CPU engine."""
        return {"PYTHONPATH": str(self.stubs), "SGLANG_USE_CPU_ENGINE": "1"}


def sglang_server(workdir: Path, name: str = "s1", **keys: object) -> dict[str, object]:
    """A ``[[server]]`` table that runs real SGLang on this machine through ``server up``: the
    SGLang venv as the launcher, its environment, the CPU flags in ``extra_args``, no graphs,
    supervision timings for a CPU server (its /health takes a second or more), a free port."""
    env = sglang_env()
    extra = [*SGLANG_CPU_FLAGS, "--random-seed", "0", *keys.pop("extra", ())]  # type: ignore[misc]
    return {
        "name": name,
        "engine": "sglang",
        "port": late_bound_port(),
        "model_path": str(env.model),
        "launcher": env.launcher(),
        "env": env.env(),
        "extra_args": extra,
        "cuda_graphs": False,
        "log_dir": str(workdir / "logs"),
        "startup_timeout_s": SGLANG_READY_S,
        "health_interval_s": 1.0,
        "health_timeout_s": 25.0,
        "health_failures": 2,
        "backoff_initial_s": 0.2,
        "backoff_max_s": 1.0,
        "stop_grace_s": 20.0,
        "drain_grace_s": 30.0,
        **keys,
    }


def sglang_env() -> SglangEnv:
    """The built environment; fails (never skips) with how to build it when it is missing."""
    default = Path.home() / ".cache" / "tokenmill" / f"sglang-{SGLANG_VERSION}"
    home = Path(os.environ.get("TOKENMILL_SGLANG_HOME") or default)
    env = SglangEnv(home)
    if not (home / ".built").exists() or not env.python.exists() or not env.model.is_dir():
        pytest.fail(
            f"the real-SGLang test environment is missing in {home}: run `make sglang-env` "
            "(built once per machine; TOKENMILL_SGLANG_HOME moves it)",
            pytrace=False,
        )
    return env


@dataclass
class Engine:
    """A running engine: its URL, main process (its group's leader) and log."""

    kind: str
    url: str
    port: int
    proc: process.Engine
    api_key: str | None = None
    members: dict[int, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> Path:
        return self.proc.log_path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.returncode() is None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def children(self) -> dict[str, int]:
        """The main process's children by title (``sglang::scheduler``, ``sglang::detokenizer``)."""
        out: dict[str, int] = {}
        for pid in process.descendants(self.pid):
            title = _cmdline(pid)
            if title.startswith("sglang::"):
                out[title.split()[0]] = pid
        return out

    def kill_child(self, title: str = "sglang::scheduler") -> int:
        pid = wait_for(lambda: self.children().get(title), 10, f"{self.kind}'s {title} process")
        os.kill(pid, signal.SIGKILL)
        return int(pid)

    def stand_in_calls(self) -> list[str]:
        """Lines where SGLang called an ``sgl_kernel`` stand-in function (must stay empty)."""
        return [line for line in self.output().splitlines() if STAND_IN_MARK in line]

    def leftovers(self) -> list[int]:
        """Processes of the engine still alive (its group, and every process it was seen with),
        without killing any: what a stop or a crash left behind."""
        pids = set(self.proc.seen) | set(process.group_members(self.proc.pgid))
        return sorted(pid for pid in pids if process.is_alive(pid))

    def stop(self, grace_s: float = 20.0) -> int | None:
        """Stop and make sure nothing of the engine is left; returns the main exit status."""
        self.proc.remember_members()
        rc = process.stop(self.proc, grace_s)
        left = process.ensure_gone(self.proc.pgid, self.proc.seen)
        assert not left, f"{self.kind} left processes behind: {left}"
        return rc


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


ENGINE_PARAMS = [pytest.param("sim"), pytest.param("sglang", marks=pytest.mark.sglang)]


def engine_argv(
    kind: str,
    port: int,
    flags: tuple[str, ...],
    api_key: str | None,
    sim_flags: tuple[str, ...] = (),
    cpus: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment that launch ``kind`` on ``port`` with SGLang ``flags``
    (``sim_flags``: the sim's own knobs, for the sim only). With ``cpus`` (a taskset list, e.g.
    ``"1"``), SGLang runs on those cores only, with one torch thread per core given."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", str(MAX_TOTAL_TOKENS)]
    if api_key:
        common += ["--api-key", api_key]
    if kind == "sim":
        argv = [sys.executable, "-m", "server_mgr.sim", *common, *SIM_FLAGS, *sim_flags, *flags]
        return argv, dict(os.environ)
    env = sglang_env()
    argv = [
        *env.launcher(),
        "--model-path",
        str(env.model),
        "--random-seed",
        "0",
        *SGLANG_CPU_FLAGS,
        *NO_GRAPH_FLAGS,
        *common,
        *flags,
    ]
    if cpus is None:
        return argv, {**os.environ, **env.env()}
    threads = str(len(os.sched_getaffinity(0) & _cpu_set(cpus)) or 1)
    pinned = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    return ["taskset", "-c", cpus, *argv], {**os.environ, **env.env(), **pinned}


def _cpu_set(cpus: str) -> set[int]:
    out: set[int] = set()
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def start_engine(
    kind: str,
    workdir: Path,
    *flags: str,
    api_key: str | None = None,
    wait_ready: bool = True,
    sim_flags: tuple[str, ...] = (),
    port: int | None = None,
    cpus: str | None = None,
) -> Engine:
    """Launch ``kind`` (``sim`` or ``sglang``) on ``port`` or a free one; with ``wait_ready``,
    return once its own process answers /health 200. SGLang binds its port only after loading
    the model, so another program may take a free port meanwhile: then the launch is tried on
    another (never when ``port`` is given)."""
    for _ in range(1 if port else 3):
        port = port or late_bound_port()
        argv, env = engine_argv(kind, port, flags, api_key, sim_flags, cpus)
        proc = process.launch(argv, env, workdir / f"{kind}-{port}.log", banner=f"# {' '.join(argv)}")
        engine = Engine(kind, f"http://127.0.0.1:{port}", port, proc, api_key)
        if not wait_ready:
            return engine
        try:
            wait_healthy(engine)
            return engine
        except PortTaken:
            engine.stop(grace_s=1.0)
            port = None
        except BaseException:  # it died, never became healthy, or is not what it was started as
            engine.stop()
            raise
    raise AssertionError(f"{kind}: another program took its port before it could bind")


def late_bound_port(low: int = 10000, high: int = 21999) -> int:
    """A free port for a server that binds it only later (SGLang, once its model is loaded), taken
    below the kernel's ephemeral range: there, no outgoing connection takes it as its own port
    meanwhile, and no ``bind(0)``. SGLang keeps its own late-bound port below that range too (at
    22000-29999); a port taken anyway is found by the launch, which tries another."""
    for port in random.sample(range(low, high + 1), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def wait_healthy(engine: Engine, timeout_s: float | None = None) -> None:
    """Wait until /health answers 200 from a process of the engine's own."""
    timeout_s = timeout_s or (SGLANG_READY_S if engine.kind == "sglang" else 30.0)

    def healthy() -> bool:
        output = engine.output()
        if dooms_the_start(output):  # uvicorn's bind error: SGLang lingers minutes after it
            raise PortTaken(engine.port)
        if not engine.alive():
            raise AssertionError(f"{engine.kind} exited {engine.proc.returncode()}:\n{output[-4000:]}")
        # Whoever listens on the port must be the engine (a stranger may never answer /health)
        owners = listeners(engine.port)
        if owners is None:
            return False
        if not owners & set(process.group_members(engine.proc.pgid)):
            raise PortTaken(engine.port)
        return http_status(f"{engine.url}/health", timeout=25) == 200

    wait_for(healthy, timeout_s, f"{engine.kind} on {engine.url} to answer /health 200", every=0.2)
    if engine.kind == "sglang":
        assert_not_the_sim(engine)


SIM_ONLY_PATH = "/_sim/stats"  # the sim's own test hook (server_mgr/sim/app.py), open without a key


def ready_or_again(engine: Engine, again: Callable[[], Engine]) -> Engine:
    """``engine`` (launched without waiting) once ready; if another program bound its free port
    first, the one ``again`` starts elsewhere. Fails with the engine's output if it died starting."""
    try:
        wait_healthy(engine)
        return engine
    except PortTaken:
        engine.stop(grace_s=1.0)
        return again()


def assert_not_the_sim(engine: Engine) -> None:
    """Fail loudly unless the engine is real SGLang: the sim answers ``GET /_sim/stats`` 200 (with
    or without a key); SGLang, past its key check, has no such route (404). A real-SGLang test
    run against the sim (a launcher or environment pointing at the wrong program) would pass
    while proving nothing about SGLang."""
    request = urllib.request.Request(engine.url + SIM_ONLY_PATH, headers=engine.headers())
    try:
        with urllib.request.urlopen(request, timeout=25) as resp:
            status, body = resp.status, resp.read()[:300]
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()[:300]
    if status != 404:
        raise AssertionError(
            f"the engine started as real SGLang on {engine.url} is not SGLang: GET {SIM_ONLY_PATH} "
            f"answered {status} {body!r}, where SGLang answers 404 (the sim serves it). Its command "
            f"and output are in {engine.log}"
        )


def listeners(port: int) -> set[int] | None:
    """PIDs with a socket listening on TCP ``port``, None if none listens (from /proc: the
    processes of other users are not seen, so an empty set means someone unknown). Cheap while
    nothing listens there."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    if not inodes:
        return None
    pids = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            links = {os.readlink(fd) for fd in fd_dir.iterdir()}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            pids.add(int(fd_dir.parent.name))
    return pids


# The engines modules share (:class:`EnginePool`), by name: each is a fixture of
# ``tests/conftest.py`` (``<name>_engine``), module-scoped and parametrized over both kinds.
# ``plain`` has no parser, an API key and metrics; ``tools`` Qwen 2.5's tool-call parser (a
# parser changes what a stream sends for every request: with one, a step with no text still
# sends its logprobs, so the two cannot be one); ``qwen3`` and ``deepseek`` a reasoning parser
# (the second streaming 4 tokens a chunk). Grammar-constrained JSON without whitespace is only
# seen by requests with a grammar.
PLAIN_FLAGS = ("--enable-metrics", "--constrained-json-disable-any-whitespace")
TOOLS_FLAGS = ("--tool-call-parser", "qwen25", "--constrained-json-disable-any-whitespace")
DEEPSEEK_INTERVAL = 4
SHARED_ENGINES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "plain": (PLAIN_FLAGS, API_KEY),
    "tools": (TOOLS_FLAGS, None),
    "qwen3": (("--reasoning-parser", "qwen3"), None),
    "deepseek": (("--reasoning-parser", "deepseek-r1", "--stream-interval", str(DEEPSEEK_INTERVAL)), None),
}


class EnginePool:
    """Engines shared across the modules of a test session, one per kind and name.

    Starting real SGLang takes 20-25 s on this machine, most of it one core importing Python, and
    most modules only read from their engine, so a module asks the pool instead of starting its
    own; a test that kills, restarts or reconfigures an engine starts its own with
    :func:`start_engine`. :meth:`launch` starts engines without waiting, so that the ones a
    session will need start side by side at its beginning; :meth:`shared` waits for health. Idle
    engines cost no CPU (SGLang runs with ``--sleep-on-idle``). An engine found dead when asked for
    fails the test loudly: nothing may stop a shared engine. Every engine is stopped when the
    session ends, with the checks of :func:`running_engine`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.engines: dict[tuple[str, str], Engine] = {}  # (kind, name) -> engine
        self._ready: set[tuple[str, str]] = set()

    def launch(self, kind: str, name: str) -> Engine:
        """The shared engine ``name`` (:data:`SHARED_ENGINES`) of ``kind``, started now if it is
        not yet, without waiting for it to be ready."""
        if (kind, name) not in self.engines:
            flags, api_key = SHARED_ENGINES[name]
            self.engines[kind, name] = start_engine(
                kind, self.workdir, *flags, api_key=api_key, wait_ready=False
            )
        return self.engines[kind, name]

    def shared(self, kind: str, name: str) -> Engine:
        """The shared engine ``name`` of ``kind``, ready."""
        engine = self.launch(kind, name)
        if (kind, name) not in self._ready:
            flags, api_key = SHARED_ENGINES[name]
            engine = self.engines[kind, name] = ready_or_again(
                engine, lambda: start_engine(kind, self.workdir, *flags, api_key=api_key)
            )
            self._ready.add((kind, name))
        elif not engine.alive():
            raise AssertionError(
                f"the shared {kind} engine {name!r} exited {engine.proc.returncode()} between tests "
                f"(a test must start its own engine to stop it):\n{engine.output()[-3000:]}"
            )
        return engine

    def close(self) -> None:
        """Stop every engine (side by side: SGLang can take seconds to exit), then check each."""
        engines = list(self.engines.values())
        self.engines.clear()
        with concurrent.futures.ThreadPoolExecutor(max(1, len(engines))) as pool:
            outcomes = list(pool.map(_stopped_or_error, engines))
        errors = [e for e in outcomes if e]
        assert not errors, "\n".join(errors)


def _stopped_or_error(engine: Engine) -> str | None:
    try:
        _stop_checked(engine)
    except AssertionError as exc:
        return str(exc)
    return None


def _stop_checked(engine: Engine) -> None:
    """Stop ``engine``, nothing of it left, and check it never called an ``sgl_kernel`` stand-in."""
    engine.stop()
    calls = engine.stand_in_calls()
    assert not calls, f"SGLang called sgl_kernel stand-ins: {calls}"


@contextmanager
def running_engine(
    kind: str, workdir: Path, *flags: str, api_key: str | None = None, sim_flags: tuple[str, ...] = ()
) -> Iterator[Engine]:
    """An engine for the duration of a block; stopped, with nothing left, afterwards."""
    engine = start_engine(kind, workdir, *flags, api_key=api_key, sim_flags=sim_flags)
    try:
        yield engine
    finally:
        _stop_checked(engine)


class SparedEngine:
    """An engine that a test kills, with its replacement started beside it from the start,
    both behind one loopback proxy (:class:`tests.faultproxy.FaultProxy`): the workers know the
    proxy's address, and :meth:`replace` points it at the replacement, as a server restarted at
    the same address. SGLang takes 20-25 s of one core to start (more on a busy machine): started
    one after the other the two starts cost a test that long again; started side by side they
    share the two cores, and the replacement waits idle (``--sleep-on-idle``) for the kill."""

    def __init__(self, kind: str, workdir: Path, *flags: str, sim_flags: tuple[str, ...] = ()) -> None:
        self._start = (kind, workdir, flags, sim_flags)
        self.spare: Engine | None = start_engine(kind, workdir, *flags, sim_flags=sim_flags, wait_ready=False)
        try:
            self.engine = start_engine(kind, workdir, *flags, sim_flags=sim_flags)
            self.proxy = FaultProxy(self.engine.port).start()
        except BaseException:
            self.spare.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.proxy.address()}"

    def replace(self) -> Engine:
        """The killed engine stopped (nothing of it left); the proxy carries new connections to
        the replacement, once it is ready."""
        assert self.spare is not None, "one replacement only"
        kind, workdir, flags, sim_flags = self._start
        self.engine.stop()
        spare, self.spare = self.spare, None
        spare = ready_or_again(spare, lambda: start_engine(kind, workdir, *flags, sim_flags=sim_flags))
        self.engine = spare
        self.proxy.replace(spare.port)
        return spare

    def close(self) -> None:
        self.proxy.close()
        for engine in (self.engine, self.spare):
            if engine is not None:
                engine.stop()


@contextmanager
def spared_engine(
    kind: str, workdir: Path, *flags: str, sim_flags: tuple[str, ...] = ()
) -> Iterator[SparedEngine]:
    """A :class:`SparedEngine` for the duration of a block; every engine stopped afterwards."""
    spared = SparedEngine(kind, workdir, *flags, sim_flags=sim_flags)
    try:
        yield spared
    finally:
        spared.close()
