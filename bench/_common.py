"""Shared parts of the benchmarks: child processes, a private Redis, the sim, workers, CPU, tables.

Every process a benchmark starts is registered on a :class:`Children` stack and stopped (SIGTERM
to its own PID, then SIGKILL) when the stack closes, also on Ctrl-C or SIGTERM. Only loopback
addresses are used.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from tokenmill.local_redis import LocalRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


def _raise_exit(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that ``finally`` blocks stop what was started."""
    signal.signal(signal.SIGTERM, _raise_exit)


@contextlib.contextmanager
def workdir(keep: bool = False, prefix: str = "tokenmill-bench-") -> Iterator[Path]:
    """A temporary directory for logs, data and Redis files; removed afterwards unless ``keep``."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        if keep:
            print(f"(kept {path})")
        else:
            shutil.rmtree(path, ignore_errors=True)


def wait_for(cond: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.05) -> T:
    """Poll ``cond`` until it returns something truthy; raise naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


@dataclass
class Child:
    """A child process with its output in a log file."""

    proc: subprocess.Popen[bytes]
    log: Path
    name: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to this process, then SIGKILL after ``grace_s``."""
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


class Children(contextlib.ExitStack):
    """Processes a benchmark started; each is stopped when the stack closes (last first)."""

    def spawn(
        self, name: str, args: Sequence[str], log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> Child:
        """``args`` as a child process run from ``cwd`` (a copy of the source: ``python -m`` imports
        from there first), its output in ``log``."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            proc = subprocess.Popen(
                list(args), stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=cwd
            )
        child = Child(proc, log, name)
        _LIVE[proc.pid] = proc
        self.callback(child.stop)
        return child

    def redis(self, where: Path) -> LocalRedis:
        """A private redis-server (AOF on, noeviction, loopback, a free port)."""
        server = LocalRedis(where).start()
        if server.proc is not None:
            _LIVE[server.proc.pid] = server.proc
        self.callback(server.stop)
        return server


_LIVE: dict[int, subprocess.Popen[bytes]] = {}  # every process a benchmark started


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def own_cpu_s() -> float:
    """CPU seconds of this process, its waited-for children and the children still running."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime
    for pid, proc in list(_LIVE.items()):
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                total += proc_cpu_s(pid)
        else:
            _LIVE.pop(pid)
    return total


def wait_quiet(max_wait_s: float = 120.0, busy_cores: float = 0.3, window_s: float = 3.0) -> float:
    """Wait (at most ``max_wait_s``) until the machine is nearly idle; returns the busy cores seen.

    Other processes on this 2-core machine (test suites, other benchmarks) skew every figure.
    """
    deadline = time.monotonic() + max_wait_s
    while True:
        b0 = busy_cpu_s()
        time.sleep(window_s)
        cores = (busy_cpu_s() - b0) / window_s
        if cores <= busy_cores or time.monotonic() > deadline:
            return cores


class MachineLoad:
    """How much CPU the rest of the machine used while a benchmark ran (it should be ~0)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0 = busy_cpu_s()
        self.own0 = own_cpu_s()

    def line(self) -> str:
        wall = time.monotonic() - self.t0
        busy = busy_cpu_s() - self.busy0
        own = own_cpu_s() - self.own0
        others = max(0.0, busy - own)
        return (
            f"machine load during the run: {busy:.0f} CPU-s busy in {wall:.0f} s, {own:.0f} of them this "
            f"benchmark's processes, {others:.0f} other processes' ({others / wall:.2f} cores on average)"
        )


def http_status(url: str, timeout_s: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def start_sim(children: Children, where: Path, knobs: Sequence[str], name: str = "sim") -> tuple[Child, str]:
    """The sim engine on a free loopback port, ready (``/health`` 200); returns (child, base URL)."""
    port = free_port()
    args = [
        sys.executable, "-m", "server_mgr.sim", "--host", "127.0.0.1", "--port", str(port),
        "--sim-startup-delay-s", "0", "--sim-warmup-s", "0", "--sim-health-latency-s", "0.01",
        "--log-level", "warning", *knobs,
    ]  # fmt: skip
    child = children.spawn(name, args, where / f"{name}-{port}.log")
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(f"{url}/health") == 200 or not child.alive(), 60, f"the sim on {url}")
    if not child.alive():
        raise RuntimeError(f"the sim exited early:\n{child.output()[-2000:]}")
    return child, url


SERVER_CPUS = "1"  # benchmarks pin SGLang here and everything else on the other core
SERVER_CPU_SET = {int(c) for c in SERVER_CPUS.split(",")}


def start_sglang(children: Children, where: Path, *flags: str, split: bool = False) -> tuple[Any, str]:
    """Real SGLang 0.5.23 (the tiny CPU model of ``make sglang-env``, as the test tier runs it) on
    a free port, ready; stopped with the stack, leaving nothing. Returns (engine, base URL); the
    engine's ``pid`` is its launcher, the group leader of its scheduler and detokenizer.

    It runs on core ``SERVER_CPUS`` with one torch thread, and :func:`pin_clients` keeps the
    benchmark's own processes on the other core, as a GPU server and its clients are apart:
    sharing both cores, the model's two torch threads stalled on each other whenever a client ran,
    and the same run took from 5 to 30 s depending on what else was running.

    With ``split``, only the scheduler (the process that drives the model, a GPU's stand-in)
    stays on ``SERVER_CPUS``; its HTTP front end and detokenizer join the clients on the other
    core (:func:`split_server`)."""
    sys.path.insert(0, str(ROOT))  # tests/ is not an installed package
    from tests.engines import start_engine

    os.environ["SGLANG_LOG_MS"] = "1"  # its log lines stamped to the ms: SglangLog.decode_steps
    engine = start_engine("sglang", where, *flags, cpus=SERVER_CPUS)
    children.callback(engine.stop)
    if split:
        split_server(engine.pid)
    return engine, engine.url


def split_server(launcher: int) -> None:
    """Leave SGLang's scheduler alone on ``SERVER_CPUS`` (the "GPU") and move its HTTP front end
    (the launcher) and detokenizer to the other cores, every thread of each."""
    from server_mgr.process import descendants

    others = set(range(os.cpu_count() or 1)) - SERVER_CPU_SET
    for pid in (launcher, *descendants(launcher)):
        try:
            comm = Path(f"/proc/{pid}/cmdline").read_bytes()
            cpus = SERVER_CPU_SET if b"sglang::scheduler" in comm else others
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), cpus)
        except OSError:
            continue


def pin_clients() -> str:
    """Keep this process and every process it starts (Redis, workers, clients) off the core SGLang
    is given; returns what was done, for the output."""
    others = os.sched_getaffinity(0) - SERVER_CPU_SET
    if not others:
        return "not pinned (one core only)"
    os.sched_setaffinity(0, others)
    return f"SGLang on core {SERVER_CPUS} (1 torch thread), the benchmark's processes on {sorted(others)}"


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants (SGLang works in its scheduler child)."""
    from server_mgr.process import descendants

    total = 0.0
    for p in (pid, *descendants(pid)):
        with contextlib.suppress(OSError):
            total += proc_cpu_s(p)
    return total


def start_worker(
    children: Children,
    where: Path,
    queue: str,
    concurrency: int,
    env: dict[str, str],
    noop_expect: int | None = None,
    source: Path = ROOT,
) -> Child:
    """A real ``tokenmill worker`` (Celery, threads pool) on ``queue``, ready to consume, run from
    the copy of the source in ``source``; with ``noop_expect``, Celery's floor instead
    (bench/noop_worker.py: the same Celery configuration, a task that does nothing), which says
    when it ran that many messages."""
    name = f"worker-{queue}-{free_port()}"
    command = [sys.executable, "-m", "tokenmill.cli", "worker"]
    if noop_expect is not None:
        command = [sys.executable, str(ROOT / "bench" / "noop_worker.py"), "--expect", str(noop_expect)]
    args = [*command, "--queue", queue, "--concurrency", str(concurrency), "--hostname", f"{name}@%h"]
    child = children.spawn(name, args, where / f"{name}.log", env, source)
    wait_for(lambda: " ready." in child.output() or not child.alive(), 90, f"{name} ready", 0.1)
    if not child.alive():
        raise RuntimeError(f"{name} exited early:\n{child.output()[-2000:]}")
    return child


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    fields = stat[stat.rindex(b")") + 2 :].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` (nanosecond run time from schedstat, not ticks)."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread ended
    return out


def thread_split(workers: list[Child], before: list[dict[int, float]]) -> dict[str, float]:
    """Worker CPU by thread: Celery's consumer (the main thread), the event loop (the busiest
    other thread: every stream of the process runs on it), and the rest (task threads, upkeep)."""
    split = {"celery consumer": 0.0, "event loop": 0.0, "task threads": 0.0}
    for w, base in zip(workers, before, strict=True):
        used = {tid: s - base.get(tid, 0.0) for tid, s in thread_cpu_s(w.pid).items()}
        split["celery consumer"] += used.pop(w.pid, 0.0)
        loop_tid = max(used, key=lambda t: used[t])
        split[f"{w.name.split('-')[1]} worker's loop"] = used[loop_tid]
        split["event loop"] += used.pop(loop_tid)
        split["task threads"] += sum(used.values())
    return split


def proc_rss_peak_mb(pid: int) -> float:
    """Peak resident set size of ``pid`` in MB (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_measured(
    args: Sequence[str], log: Path, env: dict[str, str] | None = None, timeout_s: float = 900
) -> Measured:
    """Run a command to completion (output to ``log``); its wall time, CPU and max RSS (``wait4``)."""
    start = time.perf_counter()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            list(args), stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=ROOT
        )
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise TimeoutError(f"{' '.join(args)} ran past {timeout_s}s")
        time.sleep(0.005)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Measured(
        wall_s=wall,
        cpu_s=usage.ru_utime + usage.ru_stime,
        max_rss_mb=usage.ru_maxrss / 1024,
        returncode=proc.returncode,
        output=log.read_text(errors="replace"),
    )


@dataclass(frozen=True, slots=True)
class Measured:
    wall_s: float
    cpu_s: float
    max_rss_mb: float
    returncode: int
    output: str


def machine() -> str:
    """One line about this machine: cores, Python, OS."""
    return (
        f"{os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))}), Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}, {time.strftime('%Y-%m-%d')}"
    )


def setting(text: str) -> tuple[str, str]:
    """An argparse type: ``NAME=VALUE``, a setting for a worker (``--worker-env``, ``--against``)."""
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. TOKENMILL_EVENT_LOOP=asyncio)")
    return name, value


def settings_text(pairs: Sequence[tuple[str, str]]) -> str:
    """``NAME=VALUE`` pairs (from :func:`setting`) as they were given on the command line."""
    return " ".join(f"{name}={value}" for name, value in pairs)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (printable as is, and pastable into docs/benchmarks.md)."""
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"


@contextlib.contextmanager
def heavy(lock: str | None) -> Iterator[None]:
    """Hold ``lock`` (flock) while a run goes, so that runs on a shared machine never overlap
    with test suites or other benchmarks; wait for a quiet machine once it is held."""
    if lock is None:
        yield
        return
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            wait_quiet(20.0, window_s=1.0)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# SGLang's scheduler log lines (0.5.23: docs/sglang-conformance.md, and server_mgr/logparse.py reads them too)
_RETRACT_RE = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")
_USED_RE = re.compile(r"#token: (\d+)")
_PREFILL_RE = re.compile(r"Prefill batch[^#]*#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")
_DECODE_RE = re.compile(r"Decode batch[^#]*#running-req: (\d+)")
# a pass's line stamped to the millisecond (SGLANG_LOG_MS=1, which the benchmarks set): its time and kind
_STAMP_RE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})[^\]]*\] (Prefill|Decode) batch", re.M)
STEP_GAP_S = 0.1  # a longer wait between two decode lines is the server idle, not a step


@dataclass(frozen=True, slots=True)
class SglangLog:
    """What SGLang's own log lines say of a stretch of its work."""

    retractions: int  # requests retracted (``KV cache pool is full. Retract requests.``)
    peak_kv: int | None  # the highest ``#token:`` (KV in use) of a decode line
    prefill_seqs: list[int]  # ``#new-seq`` of each prefill batch
    new_tokens: int  # prompt tokens computed (``#new-token``, summed over the prefill batches)
    cached_tokens: int  # prompt tokens found in the prefix cache (``#cached-token``)
    decode_running: list[int]  # ``#running-req`` of each logged decode step (every 40th unless
    # --decode-log-interval)
    # by running requests: the decode steps that followed a decode step, and the seconds they
    # took (each line's stamp less the one before; with --decode-log-interval 1 and
    # SGLANG_LOG_MS=1 only, else empty): how fast the host ran each size of batch
    decode_steps: dict[int, tuple[int, float]]

    @classmethod
    def parse(cls, text: str) -> SglangLog:
        prefills = [(int(s), int(n), int(c)) for s, n, c in _PREFILL_RE.findall(text)]
        used = [int(m) for m in _USED_RE.findall(text)]
        return cls(
            retractions=sum(int(n) for n in _RETRACT_RE.findall(text)),
            peak_kv=max(used, default=None),
            prefill_seqs=[s for s, _, _ in prefills],
            new_tokens=sum(n for _, n, _ in prefills),
            cached_tokens=sum(c for _, _, c in prefills),
            decode_running=[int(n) for n in _DECODE_RE.findall(text)],
            decode_steps=_decode_steps(text),
        )

    @classmethod
    def since(cls, log: Path, offset: int) -> SglangLog:
        """The lines written to ``log`` from byte ``offset`` on."""
        with open(log, "rb") as fh:
            fh.seek(offset)
            return cls.parse(fh.read().decode(errors="replace"))


def _decode_steps(text: str) -> dict[int, tuple[int, float]]:
    """SglangLog.decode_steps: a decode step is timed from the line before it when that line is a
    decode step's too (a prefill line is written before its pass, a decode line after its)."""
    steps: dict[int, tuple[int, float]] = {}
    last: tuple[float, str] | None = None
    for m in _STAMP_RE.finditer(text):
        at = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f").timestamp()
        if m[2] == "Decode" and last is not None and last[1] == "Decode" and at - last[0] < STEP_GAP_S:
            running = _DECODE_RE.match(text, m.start(2))
            if running:
                n, total = steps.get(int(running[1]), (0, 0.0))
                steps[int(running[1])] = (n + 1, total + at - last[0])
        last = (at, m[2])
    return steps


def host_speeds(steps: list[dict[int, tuple[int, float]]], rounds: int = 50) -> list[float]:
    """How slowly the host ran each run (1: the runs' mean), from its decode steps (each run's
    ``SglangLog.decode_steps``): a step of ``b`` running requests takes ``speed[run] * cost[b]``,
    both fitted to every step of every run (alternately, each given the other). Runs that share
    no size of batch with the others are fitted by their own; a run without steps counts 1.

    This host's speed moves between runs (the same fixed setting of a cell took from 9.9 to 13.1
    s, 2026-12-05): a run's wall divided by its speed is the wall at the runs' common speed. A
    step's cost grows with its batch, so runs are compared step size by step size."""
    speed = [1.0] * len(steps)
    for _ in range(rounds):
        acc: dict[int, list[float]] = {}
        for sp, run in zip(speed, steps, strict=True):
            for b, (n, total) in run.items():
                c = acc.setdefault(b, [0.0, 0.0])
                c[0], c[1] = c[0] + n, c[1] + total / sp
        cost = {b: total / n for b, (n, total) in acc.items()}
        speed = [
            sum(t for _, t in run.values()) / sum(n * cost[b] for b, (n, _) in run.items()) if run else 1.0
            for run in steps
        ]
        mean = sum(speed) / len(speed)
        speed = [sp / mean for sp in speed]
    return speed
