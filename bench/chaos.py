"""Chaos, the long form: every fault kind of ``tests/test_chaos.py`` injected several times in one run.

One private redis-server (AOF everysec), one sim, two ``short`` workers and one ``long`` worker,
all real processes. Two runs share them:

- ``chaos``: ``--prompts`` prompts of 75-525 tokens (reasoning on, 10 ms a token, max_tokens
  400), on the short queue. The faults strike it while jobs are mid-stream, round after round
  (``--reps``): worker SIGKILL (a new worker starts), sim SIGKILL (restarted on its port after
  2 s), Redis SIGKILL (restarted from its AOF after 2 s; ``tokenmill resume`` after the last),
  ``CLIENT PAUSE 2000 ALL``, duplicated deliveries, worker SIGTERM (a new worker starts);
- ``chaos-enqueue``: ``--enqueue-rows`` rows (~700 bytes each) whose ``tokenmill enqueue`` is
  SIGKILLed ``--reps`` times mid-way and rerun to the end; 4-token outputs, on the long queue.

A ``tokenmill seal`` loop seals done results into shards all along (40 a shard, or after 2 s),
so Redis crashes and pauses also strike it; each round a second sealer is SIGKILLed at each step
of the sealing protocol in turn (``--crash-at``). Once the runs finish and everything is sealed,
a shard of the ``chaos`` run is deleted: the export must name it, ``tokenmill repair`` requeue its
jobs, and the workers and the sealer bring them back.

Then both runs are audited (one ``done`` per distinct prompt, one export row each, byte-exact
against the sim, counts that match) and a table reports the faults, what was lost, duplicated
and continued, the tokens generated (the sims' counters, summed over restarts) and thrown away,
and how long a dead worker's jobs took to run again. A worker that stops by itself is replaced
(as compose's restart policy would) and reported. Every process is killed at the end, also on
Ctrl-C or SIGTERM.

    .venv/bin/python bench/chaos.py                                  # ~4 minutes
    .venv/bin/python bench/chaos.py --prompts 300 --reps 1 --enqueue-rows 5000
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _common import exit_on_sigterm, machine, median, table, workdir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ is not an installed package
from producer.sealing import STEPS
from tests import chaos, sealing
from tests.chaos import Cluster, Fault, Workload
from tests.procs import worker_env
from tokenmill import keys

MEAN = 300
SIM = ("--reasoning-parser", "qwen3", "--sim-step-ms", "10", "--sim-mean-output-tokens", str(MEAN),
       "--sim-prefill-tokens-per-ms", "2000")  # fmt: skip
GRACE_S = float(worker_env("", "")["TOKENMILL_SHUTDOWN_GRACE_S"])
RECLAIM_SLACK_S = 1.5  # as in tests/test_chaos.py: a free thread picks the requeued job up
KINDS = ("worker SIGKILL", "sim SIGKILL", "redis SIGKILL", "redis CLIENT PAUSE", "duplicate delivery",
         "worker SIGTERM")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=600, help="prompts of the run the faults strike")
    p.add_argument("--reps", type=int, default=3, help="injections of each fault kind")
    p.add_argument("--enqueue-rows", type=int, default=20000, help="rows of the killed producer's file")
    p.add_argument("--workers", type=int, default=2, help="short-queue workers")
    p.add_argument("--concurrency", type=int, default=8, help="threads per short-queue worker")
    p.add_argument("--timeout", type=float, default=900, help="most seconds to wait for the runs to finish")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, Redis files)")
    return p.parse_args()


# --- death → running again, watched in the background ---------------------------------------------


@dataclass(eq=False)
class ReclaimWatch:
    """Polls the jobs a dead worker left behind; records when each is claimed again."""

    c: Cluster
    run: str
    pending: dict[str, tuple[str, float, int]] = field(default_factory=dict)  # job -> (kind, since, token)
    delays: dict[str, list[float]] = field(default_factory=dict)  # kind -> seconds
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, since: float, jobs: dict[str, chaos.JobView]) -> None:
        with self.lock:
            self.pending.update({j: (kind, since, v.token) for j, v in jobs.items()})

    def loop(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.poll()
            except Exception:  # Redis may be down: the next poll tries again
                continue

    def poll(self) -> None:
        with self.lock:
            pending = dict(self.pending)
        views = chaos.job_views(self.c.client, self.run, pending)
        with self.lock:
            for j, v in views.items():
                kind, since, token = pending[j]
                if v.token > token and j in self.pending:
                    self.delays.setdefault(kind, []).append(v.claimed_ms / 1000 - since)
                    if v.reaped_ms / 1000 > since:
                        self.delays.setdefault(f"{kind} reaped", []).append(v.reaped_ms / 1000 - since)
                    del self.pending[j]

    def start(self) -> None:
        threading.Thread(target=self.loop, name="reclaim-watch", daemon=True).start()


# --- the faults ----------------------------------------------------------------------------------


@dataclass(eq=False)
class Chaos:
    """The fault schedule on the ``chaos`` run, and what it observed."""

    c: Cluster
    wl: Workload
    watch: ReclaimWatch
    concurrency: int
    failures: list[str] = field(default_factory=list)  # faults that could not be injected or checked
    resumed: str = ""

    def inject(self, kind: str, last_round: bool) -> Fault:
        c, run = self.c, self.wl.run
        if kind == "worker SIGKILL":
            f = chaos.kill_worker(c, run, chaos.busiest_worker(c, run, 2), replace=False)
            c.start_workers(1, concurrency=self.concurrency)
            self.watch.add(kind, f.at, f.hit)
        elif kind == "sim SIGKILL":
            f = chaos.kill_sim(c, run, min_jobs=3, down_s=2.0)
        elif kind == "redis SIGKILL":
            f = chaos.kill_redis(c, run, min_jobs=3, down_s=2.0)
            if last_round:  # its republished duplicates would sit in front of later measurements
                self.resumed = chaos.resume(c, run)
        elif kind == "redis CLIENT PAUSE":
            f = chaos.pause_redis(c, run, 2000)
        elif kind == "duplicate delivery":
            f = chaos.duplicate_messages(c, run, n=20)
        else:
            f = chaos.sigterm_worker(c, run, chaos.busiest_worker(c, run, 2), GRACE_S)
            released = {j: f.hit[j] for j in f.notes["released"]}
            self.watch.add(kind, f.at + GRACE_S, released)  # released when the grace period ends
            c.start_workers(1, concurrency=self.concurrency)
        return f

    def crash_sealers(self, rep: int, log: Callable[[str], None]) -> None:
        """A second sealer SIGKILLed at each step of the protocol in turn (the loop runs on)."""
        for step in STEPS:
            f = chaos.crash_sealer(self.c, step)
            out = f.notes["output"]
            said = "died there" if out == "killed" else f"did not get there: {out.strip().splitlines()[-1]}"
            log(f"sealer SIGKILL at {step} #{rep + 1}: {said}")
            if "Traceback" in out or "error" in out.lower():
                self.failures.append(f"sealer crash at {step} #{rep + 1}: {out[-300:]}")

    def rounds(self, reps: int, log: Callable[[str], None]) -> None:
        for rep in range(reps):
            self.crash_sealers(rep, log)
            for kind in KINDS:
                if _finished(self.c, self.wl):
                    self.failures.append(f"the run finished before {kind} #{rep + 1}")
                    return
                try:
                    f = self.inject(kind, last_round=rep == reps - 1)
                    log(f"{kind} #{rep + 1}: hit {len(f.hit)} job(s) {_brief(f)}")
                    chaos.wait_progress(self.c.client, self.wl.run, 1, timeout=120)
                    revive(self.c, log)
                except AssertionError as exc:  # a wait ran out: note it, go on with the next fault
                    self.failures.append(f"{kind} #{rep + 1}: {str(exc).splitlines()[0]}")
                    log(f"{kind} #{rep + 1}: FAILED {self.failures[-1]}")


def revive(c: Cluster, log: Callable[[str], None]) -> None:
    """Replace workers that stopped by themselves (as compose's restart policy would), saying so."""
    for why in c.revive():
        log(f"a worker stopped by itself, replaced: {why}")


def _finished(c: Cluster, wl: Workload) -> bool:
    counts = chaos.state_counts(c.client, wl.run)
    return counts["queued"] + counts["running"] == 0


def _brief(f: Fault) -> str:
    n = f.notes
    if f.kind == "sim SIGKILL":
        burned = len(n["failed_or_burned_while_down"])
        return f"(released {len(n['released'])}, failed or burned a retry while down: {burned})"
    if f.kind == "worker SIGTERM":
        finished, released = len(n["finished_in_grace"]), len(n["released"])
        return f"(finished in grace {finished}, released {released}, exit after {n['exit_s']:.1f} s)"
    if f.kind == "duplicate delivery":
        return f"({n['copies']} copies)"
    if f.kind == "redis SIGKILL":
        return f"(done {n['done_before']} before, {n['done_after_restart']} after the AOF replay)"
    return ""


def kill_producer_rounds(c: Cluster, wl: Workload, reps: int, log: Callable[[str], None]) -> list[Fault]:
    """SIGKILL ``tokenmill enqueue`` of ``wl`` ``reps`` times, each once it created new jobs, then
    rerun it to the end."""
    path = wl.write(c.workdir)
    faults: list[Fault] = []
    created = 0
    for rep in range(reps):
        f = chaos.kill_producer(c, wl, path, after_jobs=created)
        created = f.notes["jobs_at_kill"]
        log(
            f"producer SIGKILL #{rep + 1}: {created} of {len(wl.rows)} jobs existed ({f.notes['returncode']})"
        )
        faults.append(f)
    log("rerun: " + c.enqueue(wl, path).strip())
    return faults


def wait_finished(c: Cluster, wl: Workload, timeout_s: float, log: Callable[[str], None]) -> None:
    """Wait for ``wl`` to finish, saying how it goes every 30 s; on timeout, say what is stuck."""
    deadline = time.monotonic() + timeout_s
    said = time.monotonic()
    while True:
        counts = chaos.state_counts(c.client, wl.run)
        if counts["queued"] + counts["running"] == 0 and counts["done"] + counts["failed"] >= len(wl.rows):
            return
        if time.monotonic() > deadline:
            raise SystemExit(
                f"run {wl.run} did not finish in {timeout_s:.0f} s: {chaos.unfinished(c.client, wl.run)}"
            )
        revive(c, log)
        if time.monotonic() - said >= 30:
            log(f"run {wl.run}: {counts}; unfinished: {chaos.unfinished(c.client, wl.run)}")
            said = time.monotonic()
        time.sleep(0.5)


def wait_sealed(
    c: Cluster, wls: tuple[Workload, ...], log: Callable[[str], None], timeout_s: float = 300
) -> None:
    """Wait until the sealer has sealed every done job of ``wls``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {wl.run: chaos.state_counts(c.client, wl.run)["done"] - sealing.sealed_count(c.client, wl.run)
                for wl in wls}  # fmt: skip
        if not any(left.values()):
            log(f"every done job sealed ({', '.join(wl.run for wl in wls)})")
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"not sealed after {timeout_s:.0f} s: {left}")
        time.sleep(0.5)


# --- the report ----------------------------------------------------------------------------------


def report(
    c: Cluster, audits: dict[str, chaos.Audit], watch: ReclaimWatch, ch: Chaos, wall_s: float
) -> list[str]:
    """Print the tables; returns the problems found (also printed)."""
    print(f"\n## Chaos — {machine()}; {wall_s:.0f} s\n")
    print(fault_table(c.faults), end="\n\n")
    print(outcome_table(audits), end="\n\n")
    generated = c.tokens_generated()
    kept = sum(a.kept_tokens for a in audits.values())
    thrown = generated - kept
    heads = ["tokens generated (sims, over restarts)", "kept (exported)", "thrown away", "% of kept"]
    print(table(heads, [[generated, kept, thrown, f"{100 * thrown / max(kept, 1):.2f}%"]]), end="\n\n")
    print(seal_table(c, audits), end="\n\n")
    print(reclaim_table(watch))
    env = worker_env("", "")
    print(f"(lease TTL {env['TOKENMILL_LEASE_TTL_S']} s, reaper every {env['TOKENMILL_REAPER_PERIOD_S']} s)")
    if ch.resumed:
        print(f"\n`tokenmill resume` after the last Redis crash: {ch.resumed}")
    found = problems(c, audits, watch, ch)
    print("\nproblems:" if found else "\nno problem: every job ended exactly once, byte-exact, in time")
    for p in found:
        print(f"- {p}")
    return found


def fault_table(faults: list[Fault]) -> str:
    injected = Counter(f.kind for f in faults)
    hit: Counter[str] = Counter()
    for f in faults:
        hit[f.kind] += len(f.hit)
    rows: list[list[object]] = [[k, injected[k], f"{hit[k]} jobs mid-stream"] for k in KINDS]
    at_kill = ", ".join(str(f.notes["jobs_at_kill"]) for f in faults if f.kind == "producer SIGKILL")
    rows.append(["producer SIGKILL", injected["producer SIGKILL"], f"jobs existing at each kill: {at_kill}"])
    died = Counter(
        f.notes["step"] for f in faults if f.kind == "sealer SIGKILL" and f.notes["output"] == "killed"
    )
    steps = ", ".join(f"{step} {died[step]}" for step in STEPS)
    rows.append(["sealer SIGKILL (--crash-at)", injected["sealer SIGKILL"], f"died at: {steps}"])
    for f in faults:
        if f.kind == "shard deleted":
            named = "named by export" if f.notes["export_named_it"] else "NOT named by export"
            rows.append(["shard deleted", 1, f"{f.notes['shard']}: {named}; repair: {f.notes['repair'][-1]}"])
    return table(["fault", "injected", "hit"], rows)


def outcome_table(audits: dict[str, chaos.Audit]) -> str:
    heads = ["run", "jobs", "done", "failed", "lost", "duplicated", "wrong text", "wrong usage",
             "continued jobs", "continued tokens", "retries burned"]  # fmt: skip
    rows = [[name, a.prompts, a.done, sum(a.failed.values()), len(a.lost), len(a.duplicated),
             len(a.wrong_text), len(a.wrong_usage), a.continued_jobs, a.continued_tokens, a.retries]
            for name, a in audits.items()]  # fmt: skip
    return table(heads, rows)


def seal_table(c: Cluster, audits: dict[str, chaos.Audit]) -> str:
    rows = []
    for run, a in audits.items():
        k = keys.RunKeys(run)
        shards = sum(c.client.scard(k.shards(p.decode())) for p in c.client.smembers(k.partitions()))
        rows.append([run, a.prompts, sealing.sealed_count(c.client, run), shards, a.sealed, a.exported])
    return table(
        ["run", "jobs", "sealed at the end", "shards", "rows read from shards", "rows exported"], rows
    )


def reclaim_table(watch: ReclaimWatch) -> str:
    rows = []
    for kind, label in (("worker SIGKILL reaped", "SIGKILL: death → requeued by the reaper"),
                        ("worker SIGKILL", "SIGKILL: death → claimed again"),
                        ("worker SIGTERM", "SIGTERM: grace over → released job claimed again")):  # fmt: skip
        d = watch.delays.get(kind, [])
        left = sum(1 for k, _, _ in watch.pending.values() if k == kind.removesuffix(" reaped"))
        rows.append([label, len(d), f"{median(d):.1f}" if d else "-", f"{max(d):.1f}" if d else "-", left])
    return table(["worker death", "jobs", "median s", "max s", "never claimed again"], rows)


def problems(c: Cluster, audits: dict[str, chaos.Audit], watch: ReclaimWatch, ch: Chaos) -> list[str]:
    """Lost, duplicated or wrong results, crashed tasks and workers, faults not injected, late
    re-claims."""
    found = [f"{name}: {p}" for name, a in audits.items() for p in a.problems()]
    crashes = c.task_crashes()
    if crashes:
        found.append(f"{len(crashes)} task(s) crashed in workers, e.g. {crashes[0]}")
    found += ch.failures
    for f in c.faults:
        if f.kind == "shard deleted" and not (
            f.notes["export_named_it"] and f.notes["repair_returncode"] == 0
        ):
            found.append(f"the deleted shard {f.notes['shard']} was not named and repaired: {f.notes}")
    found += [f"a worker stopped by itself (replaced): {why}" for why in c.deaths]
    env = worker_env("", "")
    bound = float(env["TOKENMILL_LEASE_TTL_S"]) + float(env["TOKENMILL_REAPER_PERIOD_S"]) + RECLAIM_SLACK_S
    killed = watch.delays.get("worker SIGKILL", [])
    late = [d for d in killed if d > bound]
    if late:
        found.append(
            f"{len(late)} of {len(killed)} jobs of SIGKILLed workers were claimed again later than a "
            f"lease TTL + a reaper period (+{RECLAIM_SLACK_S} s): after up to {max(late):.0f} s"
        )
    return found


def main() -> int:
    args = parse_args()
    exit_on_sigterm()
    start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - start:6.1f}s] {msg}", flush=True)

    with workdir(keep=args.keep, prefix="tokenmill-chaos-") as where:
        c = Cluster.start(where, sim_flags=SIM)
        try:
            main_wl = Workload("chaos", chaos.prompt_rows("chaos", args.prompts), 400, MEAN)
            feed_rows = chaos.prompt_rows("feed", args.enqueue_rows, pad_words=100)
            feed_wl = Workload("chaos-enqueue", feed_rows, 4, MEAN, queue="long")
            c.start_workers(args.workers, concurrency=args.concurrency)
            c.start_workers(1, concurrency=32, queue="long")
            c.start_sealer(seal_batch_jobs=40, seal_after_s=2, seal_check_s=0.5)
            log(c.enqueue(main_wl).strip())
            kill_producer_rounds(c, feed_wl, args.reps, log)
            watch = ReclaimWatch(c, main_wl.run)
            watch.start()
            ch = Chaos(c, main_wl, watch, args.concurrency)
            ch.rounds(args.reps, log)
            for wl in (main_wl, feed_wl):
                wait_finished(c, wl, args.timeout, log)
            wait_sealed(c, (main_wl, feed_wl), log)
            f = chaos.delete_shard(c, main_wl.run)
            log(f"shard {f.notes['shard']} deleted: named by export {f.notes['export_named_it']}; "
                f"repair: {' / '.join(f.notes['repair'])}")  # fmt: skip
            wait_finished(c, main_wl, args.timeout, log)
            wait_sealed(c, (main_wl,), log)
            audits = {}
            for wl in (main_wl, feed_wl):
                audits[wl.run] = chaos.audit(c, wl, where / f"out-{wl.run}", timeout=60)
                log(f"run {wl.run} finished and audited")
            watch.stop.set()
            watch.poll()
            return 1 if report(c, audits, watch, ch, time.monotonic() - start) else 0
        finally:
            c.close()


if __name__ == "__main__":
    sys.exit(main())
