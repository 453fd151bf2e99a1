"""Fault injection on real processes, shared by ``tests/test_chaos.py`` and ``bench/chaos.py``.

A :class:`Cluster` is a redis-server, one sim engine and Celery workers, each a real process. A
fault waits until jobs are mid-stream (``running`` with a checkpoint in the ledger), strikes with
a real signal or a real Redis command, and returns a :class:`Fault` naming the jobs it hit.
:func:`audit` then checks the finished run end to end: one ``done`` result per distinct prompt,
counts that match the jobs, one export row each, and every text (continued or not) equal byte for
byte to the sim's deterministic output.

Times are wall-clock seconds (``time.time()``) so that they compare with the ledger's
``claimed_ms`` (Redis ``TIME`` on the same host).
"""

from __future__ import annotations

import base64
import signal
import socket
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from tests import sealing
from tests.finishing import all_job_ids
from tests.pipeline import cli, expected_for, read_export, write_jsonl
from tests.procs import Proc, RedisServer, sim_stats, spawn, start_sim, wait_for, worker_env
from tokenmill import keys
from tokenmill.local_redis import free_port
from tokenmill.messages import task_message

JOB_FIELDS = (
    "state",
    "worker",
    "token",
    "attempts",
    "retries",
    "claimed_ms",
    "ckpt_tokens",
    "last_error_class",
    "reaped_ms",
)
WORDS = ("alpha", "beta", "gamma", "δέλτα", "日本語", "emoji🙂", "naïve", "zeta", "lease", "token")
TASK_CRASH = "raised unexpected"  # what Celery logs when a task body raises


# --- workloads -----------------------------------------------------------------------------------


def prompt_rows(tag: str, n: int, pad_words: int = 0) -> tuple[dict[str, Any], ...]:
    """``n`` distinct prompt rows (with unicode); ``pad_words`` makes each row bigger."""
    pad = " " + " ".join(WORDS[i % len(WORDS)] for i in range(pad_words)) if pad_words else ""
    return tuple(
        {"prompt": f"{tag} #{i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(i % 5 + 2)) + pad}
        for i in range(n)
    )


@dataclass(frozen=True, slots=True)
class Workload:
    """A run of one partition, and the knobs that decide the sim's exact output for it."""

    run: str
    rows: tuple[dict[str, Any], ...]
    max_tokens: int
    mean_output_tokens: int
    reasoning: bool = True
    partition: str = "P"
    queue: str = "short"

    @property
    def enqueue_flags(self) -> list[str]:
        n = str(self.max_tokens)
        flags = [
            "--run",
            self.run,
            "--partition",
            self.partition,
            "--short-max-tokens",
            n,
            "--long-max-tokens",
            n,
        ]
        return flags + (["--long-prompt-tokens", "1"] if self.queue == "long" else [])

    def write(self, where: Path) -> Path:
        return write_jsonl(where / f"{self.run}-{self.partition}.jsonl", list(self.rows))


def prompt_key(messages: list[dict[str, Any]]) -> bytes:
    """A prompt's identity: its messages as JSON with sorted keys (the ledger stores them so)."""
    return orjson.dumps(messages, option=orjson.OPT_SORT_KEYS)


def row_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    return row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]


# --- the ledger, read from outside ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobView:
    """One job's claim and checkpoint fields as the ledger holds them."""

    job_id: str
    state: str
    worker: str
    token: int
    attempts: int
    retries: int
    claimed_ms: int
    ckpt_tokens: int
    last_error_class: str
    reaped_ms: int  # when the reaper last requeued it (0: never)


def _view(job_id: str, values: list[bytes | None]) -> JobView:
    s = [v.decode() if v is not None else "" for v in values]
    n = [int(x) if x.isdigit() else 0 for x in s]
    return JobView(job_id, s[0], s[1], n[2], n[3], n[4], n[5], n[6], s[7], n[8])


def job_views(client: redis.Redis, run: str, job_ids: Iterable[str]) -> dict[str, JobView]:
    ids = list(job_ids)
    k = keys.RunKeys(run)
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(k.job(job_id), list(JOB_FIELDS))
    return {j: _view(j, v) for j, v in zip(ids, pipe.execute(), strict=True)}


def running_jobs(client: redis.Redis, run: str) -> dict[str, JobView]:
    """Jobs that are ``running`` under a lease (live or expired)."""
    ids = [x.decode() for x in client.zrange(keys.RunKeys(run).leases(), 0, -1)]
    return {j: v for j, v in job_views(client, run, ids).items() if v.state == "running"}


def worker_id(proc: Proc) -> str:
    """The id a worker process claims jobs under (``workers.runtime.Runtime.worker_id``)."""
    return f"{socket.gethostname()}:{proc.proc.pid}"


def mid_stream(client: redis.Redis, run: str, worker: str | None = None) -> dict[str, JobView]:
    """Running jobs that already checkpointed some tokens (held by ``worker``, if given)."""
    return {
        j: v
        for j, v in running_jobs(client, run).items()
        if v.ckpt_tokens > 0 and (worker is None or v.worker == worker)
    }


def wait_mid_stream(
    client: redis.Redis, run: str, n: int = 1, worker: str | None = None, timeout: float = 60
) -> dict[str, JobView]:
    """At least ``n`` jobs mid-stream with a checkpoint; returns every running job then."""
    what = f"{n} job(s) of run {run} mid-stream with a checkpoint" + (f" on {worker}" if worker else "")
    wait_for(lambda: len(mid_stream(client, run, worker)) >= n, timeout, what, 0.02)
    return {j: v for j, v in running_jobs(client, run).items() if worker is None or v.worker == worker}


def state_counts(client: redis.Redis, run: str) -> dict[str, int]:
    """The run's counts hash summed over partitions (what ``status`` shows)."""
    out = dict.fromkeys(keys.STATES, 0)
    for f, v in client.hgetall(keys.RunKeys(run).counts()).items():
        state, _ = keys.split_count_field(f.decode())
        out[state] = out.get(state, 0) + int(v)
    return out


def wait_progress(client: redis.Redis, run: str, commits: int = 1, timeout: float = 60) -> None:
    """Wait until ``commits`` more jobs are done than now (the run moves again)."""
    start = state_counts(client, run)["done"]
    wait_for(
        lambda: state_counts(client, run)["done"] >= start + commits, timeout, f"{commits} commit(s)", 0.05
    )


def wait_finished(client: redis.Redis, run: str, total: int, timeout: float) -> None:
    """All ``total`` jobs are ``done`` or ``failed``: the counts hash says so (a cheap poll), or
    else the jobs' own states do (read every 2 s only: the audit compares the two)."""
    read_states_at = time.monotonic() + 2

    def finished() -> bool:
        nonlocal read_states_at
        counts = state_counts(client, run)
        if counts["queued"] + counts["running"] == 0 and counts["done"] + counts["failed"] >= total:
            return True
        if time.monotonic() < read_states_at:
            return False
        read_states_at = time.monotonic() + 2
        views = job_views(client, run, all_job_ids(client, run))
        return len(views) >= total and all(v.state in ("done", "failed") for v in views.values())

    wait_for(finished, timeout, f"all {total} jobs of run {run} to finish", 0.2)


def redis_now_ms(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


def wait_leases_expired(client: redis.Redis, run: str, timeout: float) -> None:
    """Every lease of ``run`` is past its expiry (by the Redis clock)."""
    leases = keys.RunKeys(run).leases()
    last = max((int(score) for _, score in client.zrange(leases, 0, -1, withscores=True)), default=0)
    wait_for(lambda: redis_now_ms(client) > last, timeout, f"the leases of run {run} to expire", 0.1)


def unfinished(client: redis.Redis, run: str) -> dict[str, int]:
    """Why the jobs of ``run`` that are not done or failed are not: a count per reason."""
    k = keys.RunKeys(run)
    on_broker = {j for q in keys.QUEUES for j in queue_messages(client, q)}
    delayed = {x.decode() for x in client.zrange(k.delayed(), 0, -1)}
    backlog = {x.decode() for q in keys.QUEUES for x in client.lrange(k.backlog(q), 0, -1)}
    now = redis_now_ms(client)
    out: dict[str, int] = {}
    for j in all_job_ids(client, run):
        state, lease = client.hmget(k.job(j), ["state", "lease"])
        if state == b"queued":
            why = ("queued, on the broker" if j in on_broker else "queued, delayed" if j in delayed
                   else "queued, on the backlog" if j in backlog else "queued, with no message")  # fmt: skip
        elif state == b"running":
            why = "running, lease live" if int(lease or 0) > now else "running, lease expired"
        else:
            continue
        out[why] = out.get(why, 0) + 1
    return out


def results(client: redis.Redis, run: str, job_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The committed result of each of ``job_ids`` (``{}`` when it has none)."""
    k = keys.RunKeys(run)
    return {j: orjson.loads(client.hget(k.job(j), "result") or b"{}") for j in job_ids}


def queue_messages(client: redis.Redis, queue: str = "short") -> dict[str, int]:
    """Job id → how many messages for it wait in the broker list of ``queue``."""
    out: dict[str, int] = {}
    for raw in client.lrange(keys.broker_queue(queue), 0, -1):
        args = orjson.loads(base64.b64decode(orjson.loads(raw)["body"]))[0]
        out[args[2]] = out.get(args[2], 0) + 1
    return out


# --- processes -----------------------------------------------------------------------------------


@dataclass(eq=False)
class Cluster:
    """A redis-server, one sim and workers, started and killed for real."""

    workdir: Path
    redis: RedisServer
    sim_flags: tuple[str, ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    owns_redis: bool = False
    sim: Proc | None = None
    sim_port: int = 0
    workers: list[Proc] = field(default_factory=list)  # live workers (a fault removes its victim)
    procs: list[Proc] = field(default_factory=list)  # everything started, for close()
    worker_args: dict[int, tuple[int, str]] = field(default_factory=dict)  # pid -> (concurrency, queue)
    deaths: list[str] = field(default_factory=list)  # workers that stopped by themselves
    faults: list[Fault] = field(default_factory=list)
    generated_by_dead_sims: int = 0
    sealer: Proc | None = None
    # where the cluster's processes reach Redis and the server (a proxy's address; default: the
    # processes' own); ``client`` reaches Redis directly all the same
    redis_via: str = ""
    server_via: str = ""
    _client: redis.Redis | None = None

    @classmethod
    def start(
        cls,
        workdir: Path,
        redis_server: RedisServer | None = None,
        sim_flags: Iterable[str] = (),
        **settings: Any,
    ) -> Cluster:
        """A running sim on a redis-server (a private one, AOF everysec, unless given)."""
        owns = redis_server is None
        server = redis_server or RedisServer(workdir / "redis").start()
        c = cls(workdir, server, tuple(sim_flags), settings, owns_redis=owns)
        c.start_sim()
        return c

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    @property
    def env(self) -> dict[str, str]:
        return worker_env(self.redis_via or self.redis.url, self.server_via or self.sim_url, **self.settings)

    @property
    def client(self) -> redis.Redis:
        """A client that fails fast while Redis is down (polls retry until their deadline)."""
        if self._client is None:
            self._client = redis.Redis.from_url(self.redis.url, socket_timeout=5, socket_connect_timeout=1)
        return self._client

    def start_sim(self) -> None:
        """Start the sim (again on the same port after a kill)."""
        self.sim, url = start_sim(self.workdir, *self.sim_flags, port=self.sim_port or None)
        self.sim_port = int(url.rsplit(":", 1)[1])
        self.procs.append(self.sim)

    def replace_sim(self, *extra_flags: str) -> None:
        """Kill the sim and start another on a new port, with ``extra_flags`` from now on; the
        tokens the killed one generated stay counted."""
        assert self.sim is not None
        self.generated_by_dead_sims += int(self.sim_stats()["generated_total"])
        self.sim.kill()
        self.sim_flags, self.sim_port = (*self.sim_flags, *extra_flags), 0
        self.start_sim()

    def start_workers(self, n: int = 1, concurrency: int = 8, queue: str = "short") -> list[Proc]:
        """``n`` real ``tokenmill worker`` processes, started side by side, each ready to consume."""
        started = []
        for _ in range(n):
            name = f"{queue}-{free_port()}"
            args = [sys.executable, "-m", "tokenmill.cli", "worker", "--queue", queue,
                    "--concurrency", str(concurrency), "--hostname", f"{name}@%h"]  # fmt: skip
            proc = spawn(args, self.workdir / f"worker-{name}.log", env=self.env)
            self.procs.append(proc)
            started.append(proc)
        for proc in started:
            wait_for(
                lambda p=proc: " ready." in p.output() or not p.alive(), 60, f"worker {proc.log.name} ready"
            )
            assert proc.alive(), proc.output()[-3000:]
            self.worker_args[proc.proc.pid] = (concurrency, queue)
        self.workers += started
        return started

    def broken_workers(self) -> list[str]:
        """Workers that stopped, or are stopping, by themselves (no fault told them to): why."""
        out = []
        for w in self.workers:
            said = [line for line in w.output().splitlines() if "Unrecoverable error" in line]
            if said or not w.alive():
                why = said[0].strip() if said else "(no error logged)"
                out.append(f"{w.log.name} (exit {w.proc.poll()}): {why}")
        return out

    def revive(self) -> list[str]:
        """Replace the workers that stopped by themselves, as a supervisor would; returns why each
        stopped (also kept in ``deaths``)."""
        broken = self.broken_workers()
        for w in [w for w in self.workers if any(b.startswith(w.log.name) for b in broken)]:
            w.kill()
            self.workers.remove(w)
            concurrency, queue = self.worker_args[w.proc.pid]
            self.start_workers(1, concurrency, queue)
        self.deaths += broken
        return broken

    def sim_stats(self) -> dict[str, Any]:
        return sim_stats(self.sim_url)

    def tokens_generated(self) -> int:
        """Tokens the sims generated, summed over every sim process (the killed ones included)."""
        live = int(self.sim_stats()["generated_total"]) if self.sim is not None and self.sim.alive() else 0
        return self.generated_by_dead_sims + live

    def enqueue(self, wl: Workload, path: Path | None = None) -> str:
        return cli("enqueue", str(path or wl.write(self.workdir)), *wl.enqueue_flags, env=self.env).stdout

    def task_crashes(self) -> list[str]:
        """Celery's "Task ... raised unexpected: ..." lines, from every worker's log."""
        return [
            line.strip()
            for p in self.procs
            if p.log.name.startswith("worker-")
            for line in p.output().splitlines()
            if TASK_CRASH in line
        ]

    @property
    def store(self) -> Path:
        """The result store the sealer writes shards to."""
        return self.workdir / "store"

    @property
    def seal_env(self) -> dict[str, str]:
        return {**self.env, "TOKENMILL_RESULTS_URL": str(self.store)}

    def start_sealer(self, **settings: Any) -> Proc:
        """A ``tokenmill seal`` loop on the cluster's result store."""
        env = {**self.seal_env, **{f"TOKENMILL_{k.upper()}": str(v) for k, v in settings.items()}}
        args = [sys.executable, "-m", "tokenmill.cli", "seal"]
        self.sealer = spawn(args, self.workdir / f"sealer-{free_port()}.log", env=env)
        self.procs.append(self.sealer)
        wait_for(lambda: "sealing into" in self.sealer.output() or not self.sealer.alive(), 30, "the sealer")
        assert self.sealer.alive(), self.sealer.output()
        return self.sealer

    def close(self) -> None:
        """Kill every process this cluster started (the test or benchmark is over)."""
        for p in reversed(self.procs):
            p.kill()
        if self.owns_redis:
            self.redis.kill()


# --- faults --------------------------------------------------------------------------------------


@dataclass(eq=False)
class Fault:
    """One injected fault: what, when (wall clock) and the jobs in flight that it hit."""

    kind: str
    at: float
    hit: dict[str, JobView]
    notes: dict[str, Any] = field(default_factory=dict)


def _record(c: Cluster, fault: Fault) -> Fault:
    c.faults.append(fault)
    return fault


def busiest_worker(c: Cluster, run: str, min_jobs: int = 1, timeout: float = 60) -> Proc:
    """The worker streaming the most jobs of ``run``, once one streams ``min_jobs`` of them."""

    def pick() -> Proc | None:
        held: dict[str, int] = {}
        for v in mid_stream(c.client, run).values():
            held[v.worker] = held.get(v.worker, 0) + 1
        best = max(c.workers, key=lambda w: held.get(worker_id(w), 0), default=None)
        return best if best is not None and held.get(worker_id(best), 0) >= min_jobs else None

    found: Proc = wait_for(pick, timeout, f"a worker streaming {min_jobs} job(s) of run {run}", 0.02)
    return found


def kill_worker(c: Cluster, run: str, victim: Proc, min_jobs: int = 2, replace: bool = True) -> Fault:
    """SIGKILL ``victim`` while it streams ``min_jobs`` jobs, then start a replacement worker."""
    wid = worker_id(victim)
    wait_mid_stream(c.client, run, min_jobs, worker=wid)
    victim.proc.send_signal(signal.SIGKILL)
    at = time.time()
    victim.proc.wait(10)
    c.workers.remove(victim)
    # the dead worker's jobs: the ledger still says it holds them, and nothing else changes that
    orphans = {j: v for j, v in running_jobs(c.client, run).items() if v.worker == wid}
    if replace:
        c.start_workers(1)
    return _record(c, Fault("worker SIGKILL", at, orphans))


def reclaim_delays(c: Cluster, run: str, fault: Fault, timeout: float = 90) -> dict[str, float]:
    """Seconds from the fault to each hit job's next claim (its ``claimed_ms`` in the ledger)."""
    delays: dict[str, float] = fault.notes.setdefault("reclaim_s", {})

    def all_reclaimed() -> bool:
        for j, v in job_views(c.client, run, [j for j in fault.hit if j not in delays]).items():
            if v.token > fault.hit[j].token:
                delays[j] = v.claimed_ms / 1000 - fault.at
        return len(delays) == len(fault.hit)

    wait_for(
        all_reclaimed, timeout, f"the {len(fault.hit)} job(s) of the dead worker to be claimed again", 0.02
    )
    return delays


def back_in_line_delays(
    c: Cluster, run: str, fault: Fault, job_ids: Iterable[str], timeout: float = 90
) -> dict[str, float]:
    """Seconds from the fault until each of ``job_ids`` is available again: its message is back on
    the broker list, or a worker claimed it (whichever is seen first; polled every 20 ms)."""
    waiting = set(job_ids)
    delays: dict[str, float] = fault.notes.setdefault("back_in_line_s", {})

    def all_back() -> bool:
        now = time.time()
        on_broker = set(queue_messages(c.client))
        for j, v in job_views(c.client, run, waiting - set(delays)).items():
            if v.token > 0:
                delays[j] = min(now, v.claimed_ms / 1000) - fault.at
            elif j in on_broker:
                delays[j] = now - fault.at
        return len(delays) == len(waiting)

    wait_for(all_back, timeout, f"the {len(waiting)} job(s) to be available again", 0.02)
    return delays


def kill_sim(c: Cluster, run: str, min_jobs: int = 3, down_s: float = 1.5) -> Fault:
    """SIGKILL the sim mid-stream; once its jobs are released keep it down ``down_s`` more while
    watching that no job fails or burns a retry; restart it on the same port."""
    assert c.sim is not None
    hit = wait_mid_stream(c.client, run, min_jobs)
    c.generated_by_dead_sims += int(c.sim_stats()["generated_total"])
    c.sim.proc.send_signal(signal.SIGKILL)
    at = time.time()
    c.sim.proc.wait(10)
    before = job_views(c.client, run, all_job_ids(c.client, run))

    def hit_released() -> dict[str, JobView] | None:
        views = job_views(c.client, run, hit)
        return (
            None if any(v.state == "running" and v.token == hit[j].token for j, v in views.items()) else views
        )

    released = wait_for(hit_released, 30, "the dead server's in-flight jobs to be released")
    burned: set[str] = set()
    deadline = time.monotonic() + down_s
    while time.monotonic() < deadline:  # the outage goes on: watch every job
        for j, v in job_views(c.client, run, before).items():
            if v.state == "failed" or v.retries > before[j].retries:
                burned.add(j)
        time.sleep(0.1)
    c.start_sim()
    notes = {"released": released, "failed_or_burned_while_down": sorted(burned), "down_s": time.time() - at}
    return _record(c, Fault("sim SIGKILL", at, hit, notes))


def kill_redis(c: Cluster, run: str, min_jobs: int = 3, down_s: float = 1.5) -> Fault:
    """SIGKILL redis-server mid-stream (at once with ``min_jobs=0``); after ``down_s`` start it
    again (same port, AOF replayed)."""
    hit = wait_mid_stream(c.client, run, min_jobs) if min_jobs else running_jobs(c.client, run)
    done_before = state_counts(c.client, run)["done"]
    c.redis.kill(signal.SIGKILL)
    at = time.time()
    time.sleep(down_s)  # the outage itself
    c.redis.start()
    notes = {"done_before": done_before, "done_after_restart": state_counts(c.client, run)["done"]}
    return _record(c, Fault("redis SIGKILL", at, hit, notes))


def crash_sealer(c: Cluster, step: str) -> Fault:
    """A second sealer (``--once --all``, marking 5 jobs a call so that ``half_marked`` falls
    inside small shards) SIGKILLed at ``step`` while the loop runs on."""
    out = sealing.crash_sealer(c.seal_env, step, "--all", "--mark-chunk", "5")
    return _record(c, Fault("sealer SIGKILL", time.time(), {}, {"step": step, "output": out}))


def delete_shard(c: Cluster, run: str) -> Fault:
    """Delete the biggest sealed shard file of ``run``; note what export and repair say."""
    victim = max(c.store.glob(f"{run}/*/*.parquet"), key=lambda p: p.stat().st_size)
    victim.unlink()
    at = time.time()
    export = cli("export", "--run", run, "--out", str(c.workdir / "lost-export"), env=c.env, check=False)
    repair = cli("repair", "--run", run, env=c.env, check=False)
    notes = {
        "shard": victim.stem,
        "export_named_it": export.returncode == 2 and f"shard {victim.stem}" in export.stderr,
        "repair": repair.stdout.strip().splitlines(),
        "repair_returncode": repair.returncode,
    }
    return _record(c, Fault("shard deleted", at, {}, notes))


def resume(c: Cluster, run: str) -> str:
    """``tokenmill resume --run RUN``: the manual path after a broker loss."""
    return cli("resume", "--run", run, env=c.env).stdout.strip()


def kill_producer(c: Cluster, wl: Workload, path: Path, after_jobs: int = 0) -> Fault:
    """SIGKILL ``tokenmill enqueue`` as soon as more than ``after_jobs`` jobs of it exist."""
    log = c.workdir / f"enqueue-{free_port()}.log"
    args = [sys.executable, "-m", "tokenmill.cli", "enqueue", str(path), *wl.enqueue_flags]
    producer = spawn(args, log, env=c.env)
    jobs = keys.RunKeys(wl.run).jobs(wl.partition)
    wait_for(lambda: c.client.llen(jobs) > after_jobs or not producer.alive(), 60, "new jobs", 0.002)
    producer.proc.send_signal(signal.SIGKILL)
    at = time.time()
    producer.proc.wait(10)

    # Redis still runs what the producer had sent before it died (a pipelined batch in its socket)
    # until it drops the connection: only then is the count of its jobs final
    def gone() -> bool:
        return all(x.get("name") != "tokenmill-enqueue" for x in c.client.client_list())

    wait_for(gone, 10, "the killed producer's connections to close", 0.01)
    notes = {"returncode": producer.proc.returncode, "jobs_at_kill": int(c.client.llen(jobs))}
    return _record(c, Fault("producer SIGKILL", at, {}, notes))


def pause_redis(c: Cluster, run: str, ms: int = 2000, min_jobs: int = 3) -> Fault:
    """``CLIENT PAUSE ms ALL`` from a separate client while jobs stream (a connection blip)."""
    hit = wait_mid_stream(c.client, run, min_jobs)
    with redis.Redis.from_url(c.redis.url) as other:
        other.execute_command("CLIENT", "PAUSE", ms, "ALL")
    at = time.time()
    wait_for(lambda: c.client.ping(), ms / 1000 + 10, "Redis to answer after the pause")
    return _record(c, Fault("redis CLIENT PAUSE", at, hit, {"ms": ms}))


def duplicate_messages(c: Cluster, run: str, queue: str = "short", n: int = 10, min_jobs: int = 2) -> Fault:
    """Deliver messages twice: copies of ``n`` queued messages (LRANGE + LPUSH), and a message for
    jobs that are mid-stream or already done (a late redelivery, built like the producer's)."""
    hit = wait_mid_stream(c.client, run, min_jobs)
    cl = c.client
    queued = cl.lrange(keys.broker_queue(queue), 0, n - 1)
    done = [j for j, v in job_views(cl, run, all_job_ids(cl, run)).items() if v.state == "done"][:n]
    k = keys.RunKeys(run)
    late = [
        task_message(run, (cl.hget(k.job(j), "partition") or b"").decode(), j, queue) for j in [*hit, *done]
    ]
    copies = [*queued, *late]
    if copies:
        cl.lpush(keys.broker_queue(queue), *copies)
    notes = {"copies": len(copies), "of_queued": len(queued), "of_running": len(hit), "of_done": len(done)}
    return _record(c, Fault("duplicate delivery", time.time(), hit, notes))


def sigterm_worker(c: Cluster, run: str, victim: Proc, grace_s: float, min_jobs: int = 2) -> Fault:
    """SIGTERM ``victim`` while it streams; watch that it claims nothing more, and how its jobs end."""
    wid = worker_id(victim)
    hit = wait_mid_stream(c.client, run, min_jobs, worker=wid)
    victim.signal(signal.SIGTERM)
    at = time.time()
    late: set[str] = set()

    def exited() -> bool:
        for j, v in running_jobs(c.client, run).items():
            if v.worker == wid and v.claimed_ms / 1000 > at + 0.1:
                late.add(j)
        return not victim.alive()

    wait_for(exited, grace_s + 30, "the SIGTERMed worker to exit", 0.05)
    exit_s = time.time() - at
    c.workers.remove(victim)
    after = job_views(c.client, run, hit)
    notes = {
        "exit_s": exit_s,
        "returncode": victim.proc.returncode,
        "late_claims": sorted(late),
        "after": after,
    }
    finished = {j for j, v in after.items() if v.token == hit[j].token and v.state == "done"}
    released = {j for j, v in after.items() if j not in finished and v.last_error_class == "shutdown"}
    notes["finished_in_grace"], notes["released"] = sorted(finished), sorted(released)
    notes["unaccounted"] = sorted(set(hit) - finished - released)
    return _record(c, Fault("worker SIGTERM", at, hit, notes))


# --- the verdict ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Audit:
    """A finished run checked against its input and the sim's deterministic output."""

    prompts: int
    exported: int = 0
    done: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    wrong_text: list[str] = field(default_factory=list)
    wrong_usage: list[str] = field(default_factory=list)
    ledger_problems: list[str] = field(default_factory=list)
    sealed: int = 0  # done jobs whose result was in a shard (whether it restarted is not known)
    continued_jobs: int = 0  # from the run's stats (commits that continued a checkpoint)
    continued_tokens: int = 0
    restarted: int = 0
    kept_tokens: int = 0
    retries: int = 0
    max_attempts: int = 0

    def problems(self) -> list[str]:
        """What breaks exactly-once or byte-exactness, one line each (empty: all good)."""
        out = list(self.ledger_problems)
        for name in ("lost", "duplicated", "wrong_text", "wrong_usage"):
            items: list[str] = getattr(self, name)
            if items:
                out.append(f"{len(items)} {name.replace('_', ' ')}: {items[:4]}")
        if self.failed:
            out.append(f"failed jobs by class: {self.failed}")
        return out


def audit(c: Cluster, wl: Workload, out: Path, timeout: float = 120) -> Audit:
    """Wait for ``wl`` to finish, then check the ledger and ``tokenmill export`` row by row."""
    wanted = {prompt_key(row_messages(r)) for r in wl.rows}
    wait_finished(c.client, wl.run, len(wanted), timeout)
    a = Audit(prompts=len(wanted))
    failed_keys = _audit_ledger(c.client, wl, a)
    cli("export", "--run", wl.run, "--out", str(out), "--include-truncated", env=c.env)
    seen: set[bytes] = set()
    for row in read_export(out).get(wl.partition, []):
        a.exported += 1
        key = prompt_key(row["messages"][:-1])
        if key in seen or key not in wanted:
            a.duplicated.append(str(row["id"]))
            continue
        seen.add(key)
        _check_row(row, wl, a)
    a.lost = [k.decode()[:60] for k in wanted - seen - failed_keys]
    return a


def _check_row(row: dict[str, Any], wl: Workload, a: Audit) -> None:
    want = expected_for(
        row, max_tokens=wl.max_tokens, reasoning=wl.reasoning, mean_output_tokens=wl.mean_output_tokens
    )
    got = row["messages"][-1]
    text = (got["content"], got.get("reasoning_content"), row["finish_reason"])
    if text != (want.content, want.reasoning_content, want.finish_reason):
        a.wrong_text.append(
            f"{row['id']}: {len(got['content'])} chars, finish {row['finish_reason']} "
            f"(want {len(want.content)} chars, finish {want.finish_reason})"
        )
    usage = row["usage"]
    if (usage["completion_tokens"], usage["prompt_tokens"]) != (want.completion_tokens, want.prompt_tokens):
        a.wrong_usage.append(
            f"{row['id']}: completion_tokens {usage['completion_tokens']} (want {want.completion_tokens}), "
            f"prompt_tokens {usage['prompt_tokens']} (want {want.prompt_tokens})"
        )
    a.kept_tokens += int(usage["completion_tokens"] or 0)


def _audit_ledger(client: redis.Redis, wl: Workload, a: Audit) -> set[bytes]:
    """Jobs list, job states and counts; returns the prompts of jobs that ended ``failed``."""
    k = keys.RunKeys(wl.run)
    ids = [x.decode() for x in client.lrange(k.jobs(wl.partition), 0, -1)]
    if len(ids) != len(set(ids)):
        a.ledger_problems.append(f"the jobs list holds {len(ids) - len(set(ids))} duplicate id(s)")
    if len(set(ids)) != a.prompts:
        a.ledger_problems.append(f"{len(set(ids))} jobs in the ledger for {a.prompts} distinct prompts")
    pipe = client.pipeline(transaction=False)
    for j in ids:
        pipe.hmget(k.job(j), ["state", "result", "error_class", "retries", "attempts", "spec"])
    actual = dict.fromkeys(keys.STATES, 0)
    failed_keys: set[bytes] = set()
    for state, result, error_class, retries, attempts, spec in pipe.execute():
        s = (state or b"?").decode()
        s = "done" if s == "sealed" else s  # a sealed job is done; its result is in its shard
        actual[s] = actual.get(s, 0) + 1
        a.retries += int(retries or 0)
        a.max_attempts = max(a.max_attempts, int(attempts or 0))
        if s == "failed":
            cls = (error_class or b"?").decode()
            a.failed[cls] = a.failed.get(cls, 0) + 1
            failed_keys.add(prompt_key(orjson.loads(spec)["request"]["messages"]))
        elif s == "done":
            a.done += 1
            a.sealed += not result
            a.restarted += bool(orjson.loads(result or b"{}").get("restarted"))
    stats = client.hmget(k.stats(), ["continued_jobs", "continued_tokens"])
    a.continued_jobs, a.continued_tokens = (int(x or 0) for x in stats)
    counts = state_counts(client, wl.run)
    if any(counts.get(s, 0) != actual.get(s, 0) for s in keys.STATES):
        a.ledger_problems.append(f"the counts hash {counts} disagrees with the jobs' states {actual}")
    return failed_keys
