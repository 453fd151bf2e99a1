"""``tokenmill demo``: the whole pipeline on one machine, with nothing running beforehand.

A private redis-server (AOF on), the sim engine, a short and a long worker, a sealer moving
done results into Parquet shards in the work directory, the bundled two-partition dataset, live
progress, an export (from the shards), and a clean shutdown of everything it started.
Each part is started through the same CLI a user runs, so the demo exercises the real contract.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib import resources
from pathlib import Path

import click
import redis
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokenmill.ledger import Ledger
from tokenmill.local_redis import LocalRedis, free_port

RUN = "demo"


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


def _wait_http_200(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"the sim exited early; see {log}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        time.sleep(0.1)
    raise click.ClickException(f"the sim was not ready within {timeout_s}s; see {log}")


def _tm(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", *args]


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
def demo(out_dir: str, keep: bool) -> None:
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
        _wait_http_200(f"{sim_url}/health", sim, 60, sim_log)
        console.print(f"[bold]sim[/]     {sim_url} (SGLang-compatible, reasoning on; log {sim_log})")
        env = {"TOKENMILL_REDIS_URL": rds.url, "TOKENMILL_SERVER_URL": sim_url}
        for queue, threads in (("short", "32"), ("long", "8")):
            stack.spawn(
                _tm("worker", "--queue", queue, "--concurrency", threads), work / f"worker-{queue}.log", env
            )
        console.print(f"[bold]workers[/] short x32, long x8 (logs in {work})")
        results = work / "results"
        seal_env = {**env, "TOKENMILL_RESULTS_URL": str(results), "TOKENMILL_SEAL_CHECK_S": "1"}
        stack.spawn(_tm("seal"), work / "sealer.log", seal_env)
        console.print(f"[bold]sealer[/]  done results → Parquet shards in {results}")
        files = [str(data.joinpath(f"{p}.jsonl")) for p in ("B1", "B2")]
        enq = subprocess.run(
            _tm(
                "enqueue",
                *files,
                "--run",
                RUN,
                "--short-max-tokens",
                "256",
                "--long-max-tokens",
                "512",
                "--long-prompt-tokens",
                "18",
            ),
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=False,
        )
        if enq.returncode:
            raise click.ClickException(f"enqueue failed: {enq.stderr.strip()}")
        console.print(f"[bold]enqueue[/] {enq.stdout.strip()}")
        client = redis.Redis.from_url(rds.url)
        _watch(console, client, timeout_s=600)
        _wait_sealed(console, client, timeout_s=60)
        exp = subprocess.run(
            _tm("export", "--run", RUN, "--out", str(out), "--include-truncated"),
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=False,
        )
        if exp.returncode:
            raise click.ClickException(f"export failed: {exp.stderr.strip()}")
        console.print(f"[bold]export[/]  {exp.stdout.strip()}")
        console.print(
            f"\nDone. Completions are in [bold]{out}[/] (one JSON object per line, one file per partition)."
        )
        console.print("Shutting down the workers, the sim and Redis…")
    if not keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        console.print(f"Logs and the Redis AOF are kept in {work}")


def _wait_sealed(console: Console, client: redis.Redis, timeout_s: float) -> None:
    """Wait for the sealer to take every done result out of Redis (it seals a partition as soon
    as nothing in it is left to run), then say what Redis holds per job."""
    ledger = Ledger(client, RUN)
    deadline = time.monotonic() + timeout_s
    done = sum(c["done"] for c in ledger.counts().values())
    while True:
        sealed = sum(int(v) for v in client.hvals(ledger.k.sealed()))
        if sealed >= done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    shards = sum(client.scard(ledger.k.shards(p)) for p in ledger.counts())
    console.print(f"[bold]sealed[/]  {sealed} of {done} done results, in {shards} shards")


def _watch(console: Console, client: redis.Redis, timeout_s: float) -> None:
    ledger = Ledger(client, RUN)
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
    stats = {k.decode(): int(v) for k, v in client.hgetall(ledger.k.stats()).items()}
    console.print(f"[bold]done[/]    {stats.get('completion_tokens', 0)} completion tokens generated")
