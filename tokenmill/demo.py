"""``tokenmill demo``: the whole pipeline on one machine, with nothing running beforehand.

A private redis-server (AOF on), the sim engine, a short and a long worker, a sealer moving
done results into Parquet shards in the work directory, the dashboard (its address is printed;
basic auth if ``TOKENMILL_DASHBOARD_BASIC_AUTH`` is set), the bundled two-partition dataset, live
progress, an export (from the shards), and a clean shutdown of everything it started (with
``--hold``, only once interrupted). Each part is started through the same CLI a user runs, so
the demo exercises the real contract.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokenmill.ledger import Ledger
from tokenmill.local_redis import LocalRedis, free_port
from tokenmill.replies import text

AUTH_ENVVAR = "TOKENMILL_DASHBOARD_BASIC_AUTH"  # producer.dashboard.cli's (not imported: a component)

RUN = "demo"
READY_S = 60  # for the sim and the dashboard to answer


class Stack(contextlib.ExitStack):
    """Child processes started by the demo, stopped (SIGTERM, then SIGKILL) on exit."""

    def spawn(self, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "ab") as fh:
            proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env})
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


def _wait_http(
    url: str, proc: subprocess.Popen[bytes], log: Path, what: str, ok: tuple[int, ...] = (200,)
) -> None:
    """Wait until ``url`` answers one of ``ok`` (a page behind basic auth answers 401)."""
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"{what} exited early; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status in ok:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code in ok:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise click.ClickException(f"{what} was not ready within {READY_S}s; see {log}")


def _tm(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", *args]


def _cli(env: dict[str, str], command: str, *args: str) -> str:
    """Run a tokenmill command to its end: what it printed, or a ClickException with its stderr."""
    done = subprocess.run(
        _tm(command, *args), env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise click.ClickException(f"{command} failed: {done.stderr.strip()}")
    return done.stdout.strip()


@click.command()
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="demo-output",
    show_default=True,
    help="Where the export is written.",
)
@click.option("--keep", is_flag=True, help="Keep the working directory (logs, Redis AOF) after the demo.")
@click.option(
    "--hold", is_flag=True, help="Keep everything running after the export (look around), until Ctrl-C."
)
def demo(out_dir: str, keep: bool, hold: bool) -> None:
    """Run the whole pipeline on this machine with the sim engine, then export."""
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="tokenmill-demo-"))
    data = resources.files("tokenmill").joinpath("data/demo")
    out = Path(out_dir).resolve()
    with Stack() as stack:
        rds = LocalRedis(work / "redis").start()
        stack.callback(rds.stop)
        console.print(f"[bold]redis[/]   {rds.url} (private, AOF on, in {work / 'redis'})")
        port = free_port()
        sim_url = f"http://127.0.0.1:{port}"
        sim_log = work / "sim.log"
        sim = stack.spawn(
            _tm(
                "server",
                "sim",
                "--port",
                str(port),
                "--reasoning-parser",
                "qwen3",
                "--sim-mean-output-tokens",
                "120",
                "--sim-health-latency-s",
                "0.05",
                "--sim-step-ms",
                "8",
            ),
            sim_log,
            {},
        )
        _wait_http(f"{sim_url}/health", sim, sim_log, "the sim")
        console.print(f"[bold]sim[/]     {sim_url} (SGLang-compatible, reasoning on; log {sim_log})")
        env = {"TOKENMILL_REDIS_URL": rds.url, "TOKENMILL_SERVER_URL": sim_url}
        # a history point a second (the default is one in ten): the demo lasts a minute or so
        worker_env = {**env, "TOKENMILL_SERIES_STEP_S": "1", "TOKENMILL_REAPER_PERIOD_S": "1"}
        for queue, threads in (("short", "32"), ("long", "8")):
            stack.spawn(
                _tm("worker", "--queue", queue, "--concurrency", threads),
                work / f"worker-{queue}.log",
                worker_env,
            )
        console.print(f"[bold]workers[/] short x32, long x8 (logs in {work})")
        _dashboard(console, stack, work, env)
        results = work / "results"
        seal_env = {**env, "TOKENMILL_RESULTS_URL": str(results), "TOKENMILL_SEAL_CHECK_S": "1"}
        stack.spawn(_tm("seal"), work / "sealer.log", seal_env)
        console.print(f"[bold]sealer[/]  done results → Parquet shards in {results}")
        files = [str(data.joinpath(f"{p}.jsonl")) for p in ("B1", "B2")]
        lengths = ("--short-max-tokens", "256", "--long-max-tokens", "512", "--long-prompt-tokens", "18")
        console.print(f"[bold]enqueue[/] {_cli(env, 'enqueue', *files, '--run', RUN, *lengths)}")
        ledger = Ledger(rds.client(), RUN)
        _watch(console, ledger, timeout_s=600)
        _wait_sealed(console, ledger, timeout_s=60)
        exported = _cli(env, "export", "--run", RUN, "--out", str(out), "--include-truncated")
        console.print(f"[bold]export[/]  {exported}")
        console.print(
            f"\nDone. Completions are in [bold]{out}[/] (one JSON object per line, one file per partition)."
        )
        if hold:
            _hold(console)
        console.print("Shutting down the workers, the sim and Redis…")
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        console.print(f"Logs and the Redis AOF are kept in {work}")


def _dashboard(console: Console, stack: Stack, work: Path, env: dict[str, str]) -> None:
    """Start the dashboard on a free loopback port and print its address."""
    port = free_port()
    log = work / "dashboard.log"
    proc = stack.spawn(_tm("dashboard", "--port", str(port)), log, env)
    url = f"http://127.0.0.1:{port}/?run={RUN}"
    _wait_http(url, proc, log, "the dashboard", ok=(200, 401))
    auth = " (basic auth: TOKENMILL_DASHBOARD_BASIC_AUTH)" if os.environ.get(AUTH_ENVVAR) else ""
    console.print(f"[bold]dashboard[/] {url}{auth} (live while the demo runs)")


def _hold(console: Console) -> None:
    """Wait for Ctrl-C or SIGTERM, everything still running."""
    console.print("Everything is still running (--hold): Ctrl-C to stop.")
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_sealed(console: Console, ledger: Ledger, timeout_s: float) -> None:
    """Wait for the sealer to take every done result out of Redis (it seals a partition as soon
    as nothing in it is left to run), then say what Redis holds per job."""
    deadline = time.monotonic() + timeout_s
    done = sum(c["done"] for c in ledger.counts().values())
    while True:
        sealed = sum(int(v) for v in ledger.r.hvals(ledger.k.sealed()))
        if sealed >= done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    shards = sum(ledger.r.scard(ledger.k.shards(p)) for p in ledger.counts())
    console.print(f"[bold]sealed[/]  {sealed} of {done} done results, in {shards} shards")


def _watch(console: Console, ledger: Ledger, timeout_s: float) -> None:
    progress = Progress(
        TextColumn("{task.description:>4}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
    )
    tasks = {}
    deadline = time.monotonic() + timeout_s
    with Live(progress, console=console, refresh_per_second=8):
        while True:
            counts = ledger.counts()
            for part, c in sorted(counts.items()):
                total = sum(c.values())
                note = f"{c['running']} running, {c['failed']} failed"
                if part not in tasks:
                    tasks[part] = progress.add_task(part, total=total, note=note)
                progress.update(tasks[part], completed=c["done"] + c["failed"], total=total, note=note)
            if counts and all(c["queued"] == 0 and c["running"] == 0 for c in counts.values()):
                break
            if time.monotonic() > deadline:
                raise click.ClickException(f"the demo run did not finish within {timeout_s}s")
            time.sleep(0.25)
    console.line()
    stats = {text(k): int(v) for k, v in ledger.r.hgetall(ledger.k.stats()).items()}
    console.print(f"[bold]done[/]    {stats.get('completion_tokens', 0)} completion tokens generated")
