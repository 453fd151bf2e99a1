"""Fault injection on real processes, shared by ``tests/test_chaos.py`` and ``bench/chaos.py``.

A :class:`Cluster` is a redis-server, one sim engine and Celery workers, each a real process. A
fault waits until jobs are mid-stream (``running`` with a checkpoint in the ledger), strikes with
a real signal or a real Redis command, and returns a :class:`Fault` naming the jobs it hit.
:func:`audit` then checks the finished run end to end: one ``done`` result per distinct prompt,
counts that match the jobs, one export row each, and every text (continued or not) equal byte for
byte to the sim's deterministic output.

Times are wall-clock seconds (``time.time()``) so that they compare with the ledger's
``claimed_ms`` (Redis ``TIME``, the same host's clock).
"""

from __future__ import annotations

import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import redis

from tests.pipeline import cli, expected_for, read_export, write_jsonl
from tests.procs import Proc, RedisServer, spawn, start_sim, start_worker, wait_for, worker_env
from tokenmill import keys
from tokenmill.local_redis import free_port
from tokenmill.messages import task_message

JOB_FIELDS = ("state", "worker", "token", "attempts", "retries", "claimed_ms", "ckpt_tokens", "last_error_class")
WORDS = ("alpha", "beta", "gamma", "δέλτα", "日本語", "emoji🙂", "naïve", "zeta", "lease", "token")


# --- workloads -----------------------------------------------------------------------------------


def prompt_rows(tag: str, n: int, pad_words: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct prompt rows (unicode included); ``pad_words`` makes each row bigger."""
    pad = " " + " ".join(WORDS[i % len(WORDS)] for i in range(pad_words)) if pad_words else ""
    return [
        {"prompt": f"{tag} #{i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(i % 5 + 2)) + pad}
        for i in range(n)
    ]


@dataclass(frozen=True, slots=True)
class Workload:
    """A run: its rows (one partition) and the knobs that decide the sim's exact output."""

    run: str
    partition: str
    rows: tuple[dict[str, Any], ...]
    max_tokens: int
    mean_output_tokens: int
    reasoning: bool = True

    @property
    def enqueue_flags(self) -> list[str]:
        n = str(self.max_tokens)
        return ["--run", self.run, "--partition", self.partition, "--short-max-tokens", n, "--long-max-tokens", n]

    def write(self, where: Path) -> Path:
        return write_jsonl(where / f"{self.run}-{self.partition}.jsonl", list(self.rows))


def prompt_key(messages: list[dict[str, Any]]) -> bytes:
    return orjson.dumps(messages)


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


def _view(job_id: str, values: list[bytes | None]) -> JobView:
    s = [v.decode() if v is not None else "" for v in values]
    return JobView(job_id, s[0], s[1], int(s[2] or 0), int(s[3] or 0), int(s[4] or 0), int(s[5] or 0),
                   int(s[6] or 0), s[7])  # fmt: skip


def job_views(client: redis.Redis, run: str, job_ids: Iterable[str]) -> dict[str, JobView]:
    ids = list(job_ids)
    k = keys.RunKeys(run)
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(k.job(job_id), list(JOB_FIELDS))
    return {j: _view(j, v) for j, v in zip(ids, pipe.execute(), strict=True)}


def all_job_ids(client: redis.Redis, run: str) -> list[str]:
    k = keys.RunKeys(run)
    out: list[str] = []
    for part in sorted(p.decode() for p in client.smembers(k.partitions())):
        out += [x.decode() for x in client.lrange(k.jobs(part), 0, -1)]
    return out


def running_jobs(client: redis.Redis, run: str) -> dict[str, JobView]:
    """Jobs that hold a lease and are ``running``."""
    ids = [x.decode() for x in client.zrange(keys.RunKeys(run).leases(), 0, -1)]
    return {j: v for j, v in job_views(client, run, ids).items() if v.state == "running"}


def worker_id(proc: Proc) -> str:
    """The id a worker process claims jobs under (``workers.runtime.Runtime.worker_id``)."""
    return f"{socket.gethostname()}:{proc.proc.pid}"


def mid_stream(client: redis.Redis, run: str, worker: str | None = None) -> dict[str, JobView]:
    """Running jobs that already checkpointed some tokens (of ``worker`` only, if given)."""
    return {
        j: v
        for j, v in running_jobs(client, run).items()
        if v.ckpt_tokens > 0 and (worker is None or v.worker == worker)
    }


def wait_mid_stream(
    client: redis.Redis, run: str, n: int = 1, worker: str | None = None, timeout: float = 60
) -> dict[str, JobView]:
    """At least ``n`` jobs mid-stream with a checkpoint (polls the ledger; fails at the deadline)."""
    what = f"{n} job(s) of run {run} mid-stream with a checkpoint" + (f" on {worker}" if worker else "")
    return wait_for(lambda: (m := mid_stream(client, run, worker)) and len(m) >= n and m, timeout, what, 0.02)


def state_counts(client: redis.Redis, run: str) -> dict[str, int]:
    """The run's counts hash summed over partitions (what ``status`` shows)."""
    out = dict.fromkeys(keys.STATES, 0)
    for f, v in client.hgetall(keys.RunKeys(run).counts()).items():
        state, _ = keys.split_count_field(f.decode())
        out[state] = out.get(state, 0) + int(v)
    return out


def wait_finished(client: redis.Redis, run: str, total: int, timeout: float) -> None:
    """Every one of ``total`` jobs is ``done`` or ``failed`` (by the jobs' own state, not counts)."""

    def finished() -> bool:
        ids = all_job_ids(client, run)
        views = job_views(client, run, ids)
        return len(ids) >= total and all(v.state in ("done", "failed") for v in views.values())

    wait_for(finished, timeout, f"all {total} jobs of run {run} to finish", 0.2)


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
    workers: list[Proc] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    generated_by_dead_sims: int = 0

    @classmethod
    def start(
        cls,
        workdir: Path,
        redis_server: RedisServer | None = None,
        sim_flags: Iterable[str] = (),
        **settings: Any,
    ) -> Cluster:
        """A running cluster (a private AOF redis-server unless ``redis_server`` is given)."""
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
        return worker_env(self.redis.url, self.sim_url, **self.settings)

    @property
    def client(self) -> redis.Redis:
        """A client that fails fast while Redis is down (polls retry until their deadline)."""
        return redis.Redis.from_url(self.redis.url, socket_timeout=5, socket_connect_timeout=1)

    def start_sim(self) -> None:
        """Start the sim (again on the same port after a kill)."""
        self.sim, url = start_sim(self.workdir, *self.sim_flags, port=self.sim_port or None)
        self.sim_port = int(url.rsplit(":", 1)[1])
        self.procs.append(self.sim)

    def start_worker(self, concurrency: int = 8, queue: str = "short") -> Proc:
        w = start_worker(self.workdir, queue, self.env, concurrency=concurrency)
        self.workers.append(w)
        self.procs.append(w)
        return w

    def sim_stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.sim_url}/_sim/stats", timeout=5) as resp:
            stats: dict[str, Any] = orjson.loads(resp.read())
        return stats

    def tokens_generated(self) -> int:
        """Tokens the sims generated, summed over every sim process (killed ones included)."""
        live = self.sim_stats()["generated_total"] if self.sim is not None and self.sim.alive() else 0
        return self.generated_by_dead_sims + int(live)

    def enqueue(self, wl: Workload, path: Path | None = None) -> str:
        return cli("enqueue", str(path or wl.write(self.workdir)), *wl.enqueue_flags, env=self.env).stdout

    def close(self) -> None:
        """Kill every process this cluster started (the test or bench is over)."""
        for p in reversed(self.procs):
            p.kill()
        if self.owns_redis:
            self.redis.kill()


# --- faults --------------------------------------------------------------------------------------


@dataclass(eq=False)
class Fault:
    """One injected fault: what, when (wall clock) and the in-flight jobs it hit."""

    kind: str
    at: float
    hit: dict[str, JobView]
    notes: dict[str, Any] = field(default_factory=dict)


def _record(c: Cluster, fault: Fault) -> Fault:
    c.faults.append(fault)
    return fault


def kill_worker(c: Cluster, run: str, victim: Proc, min_jobs: int = 2, replace: bool = True) -> Fault:
    """SIGKILL ``victim`` while it streams ``min_jobs`` jobs; start a replacement worker."""
    wid = worker_id(victim)
    wait_mid_stream(c.client, run, min_jobs, worker=wid)
    victim.proc.send_signal(signal.SIGKILL)
    at = time.time()
    victim.proc.wait(10)
    c.workers.remove(victim)
    # the dead worker's jobs: the ledger still says it holds them (nothing else changes them)
    orphans = {j: v for j, v in running_jobs(c.client, run).items() if v.worker == wid}
    if replace:
        c.start_worker()
    return _record(c, Fault("worker SIGKILL", at, orphans))


def reclaim_delays(c: Cluster, run: str, fault: Fault, timeout: float = 60) -> dict[str, float]:
    """Seconds from the fault to each hit job's next claim (its ``claimed_ms`` in the ledger)."""
    delays: dict[str, float] = {}

    def all_reclaimed() -> bool:
        for j, v in job_views(c.client, run, [j for j in fault.hit if j not in delays]).items():
            if v.token > fault.hit[j].token:
                delays[j] = v.claimed_ms / 1000 - fault.at
        return len(delays) == len(fault.hit)

    wait_for(all_reclaimed, timeout, f"the {len(fault.hit)} job(s) of the killed worker to be claimed again", 0.02)
    fault.notes["reclaim_s"] = delays
    return delays


def kill_sim(c: Cluster, run: str, min_jobs: int = 3, down_s: float = 1.5) -> Fault:
    """SIGKILL the sim mid-stream, keep it down ``down_s`` after its jobs are released, restart it
    on the same port. While it is down no job may fail or burn a retry."""
    assert c.sim is not None
    hit = wait_mid_stream(c.client, run, min_jobs)
    c.generated_by_dead_sims += int(c.sim_stats()["generated_total"])
    c.sim.proc.send_signal(signal.SIGKILL)
    at = time.time()
    c.sim.proc.wait(10)
    before = job_views(c.client, run, all_job_ids(c.client, run))

    def hit_released() -> dict[str, JobView] | None:
        views = job_views(c.client, run, hit)
        return None if any(v.state == "running" for v in views.values()) else views

    released = wait_for(hit_released, 30, "the dead server's in-flight jobs to be released")
    deadline = time.monotonic() + down_s
    burned: set[str] = set()
    while time.monotonic() < deadline:  # the outage: watch that nothing fails or burns a retry
        for j, v in job_views(c.client, run, before).items():
            if v.state == "failed" or v.retries > before[j].retries:
                burned.add(j)
        time.sleep(0.1)
    c.start_sim()
    return _record(
        c,
        Fault(
            "sim SIGKILL",
            at,
            hit,
            {"released": released, "failed_or_burned_while_down": sorted(burned), "down_s": time.time() - at},
        ),
    )


def kill_redis(c: Cluster, run: str, min_jobs: int = 3, down_s: float = 1.5) -> Fault:
    """SIGKILL redis-server mid-stream; after ``down_s`` restart it (same port, AOF replayed)."""
    hit = wait_mid_stream(c.client, run, min_jobs)
    done_before = state_counts(c.client, run)["done"]
    c.redis.kill(signal.SIGKILL)
    at = time.time()
    time.sleep(down_s)  # the outage itself
    c.redis.start()
    done_after = state_counts(c.client, run)["done"]
    notes = {"done_before": done_before, "done_after_restart": done_after, "down_s": time.time() - at}
    return _record(c, Fault("redis SIGKILL", at, hit, notes))


def resume(c: Cluster, run: str) -> str:
    """``tokenmill resume --run RUN`` (the manual path after a broker loss)."""
    return cli("resume", "--run", run, env=c.env).stdout


def kill_producer(c: Cluster, wl: Workload, path: Path) -> Fault:
    """SIGKILL ``tokenmill enqueue`` once some of its jobs exist, then run it again to the end."""
    log = c.workdir / f"enqueue-{free_port()}.log"
    args = [sys.executable, "-m", "tokenmill.cli", "enqueue", str(path), *wl.enqueue_flags]
    producer = spawn(args, log, env=c.env)
    k = keys.RunKeys(wl.run)
    wait_for(lambda: c.client.llen(k.jobs(wl.partition)) > 0 or not producer.alive(), 60, "the first jobs", 0.002)
    producer.proc.send_signal(signal.SIGKILL)
    at = time.time()
    producer.proc.wait(10)
    created = int(c.client.llen(k.jobs(wl.partition)))
    rerun = c.enqueue(wl, path)
    notes = {"returncode": producer.proc.returncode, "jobs_at_kill": created, "rerun": rerun.strip()}
    return _record(c, Fault("producer SIGKILL", at, {}, notes))


def pause_redis(c: Cluster, run: str, ms: int = 2000, min_jobs: int = 3) -> Fault:
    """``CLIENT PAUSE ms ALL`` from a separate client while jobs stream (a connection blip)."""
    hit = wait_mid_stream(c.client, run, min_jobs)
    redis.Redis.from_url(c.redis.url).execute_command("CLIENT", "PAUSE", ms, "ALL")
    at = time.time()
    wait_for(lambda: c.client.ping(), ms / 1000 + 10, "Redis to answer after the pause")
    return _record(c, Fault("redis CLIENT PAUSE", at, hit, {"ms": ms}))


def duplicate_messages(c: Cluster, run: str, queue: str = "short", n: int = 10, min_jobs: int = 2) -> Fault:
    """Deliver messages twice: copies of ``n`` queued messages (LRANGE + LPUSH), and a fresh message
    for jobs that are mid-stream or already done (a late redelivery)."""
    hit = wait_mid_stream(c.client, run, min_jobs)
    queued = c.client.lrange(keys.broker_queue(queue), 0, n - 1)
    k = keys.RunKeys(run)
    done = [j for j, v in job_views(c.client, run, all_job_ids(c.client, run)).items() if v.state == "done"][:n]
    extra = [task_message(run, (c.client.hget(k.job(j), "partition") or b"").decode(), j, queue) for j in [*hit, *done]]
    copies = [*queued, *extra]
    if copies:
        c.client.lpush(keys.broker_queue(queue), *copies)
    notes = {"copies": len(copies), "of_queued": len(queued), "of_running": len(hit), "of_done": len(done)}
    return _record(c, Fault("duplicate delivery", time.time(), hit, notes))


def sigterm_worker(c: Cluster, run: str, victim: Proc, grace_s: float, min_jobs: int = 2) -> Fault:
    """SIGTERM ``victim`` while it streams; watch that it claims nothing more and exits after the
    grace period, its unfinished jobs checkpointed and released."""
    wid = worker_id(victim)
    hit = wait_mid_stream(c.client, run, min_jobs, worker=wid)
    victim.signal(signal.SIGTERM)
    at = time.time()
    late: set[str] = set()

    def exited() -> bool:
        for j, v in running_jobs(c.client, run).items():
            if v.worker == wid and v.claimed_ms / 1000 > at + 0.2:
                late.add(j)
        return not victim.alive()

    wait_for(exited, grace_s + 30, "the SIGTERMed worker to exit", 0.05)
    exit_s = time.time() - at
    c.workers.remove(victim)
    after = job_views(c.client, run, hit)
    notes = {
        "exit_s": exit_s,
        "late_claims": sorted(late),
        "finished_in_grace": sorted(j for j, v in after.items() if v.state == "done"),
        "released": sorted(j for j, v in after.items() if v.state == "queued"),
        "after": after,
    }
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
    continued_jobs: int = 0
    continued_tokens: int = 0
    restarted: int = 0
    kept_tokens: int = 0
    retries: int = 0

    def problems(self) -> list[str]:
        """Everything that breaks exactly-once or byte-exactness, one line each (empty: all good)."""
        out = list(self.ledger_problems)
        for name in ("lost", "duplicated", "wrong_text", "wrong_usage"):
            items: list[str] = getattr(self, name)
            if items:
                out.append(f"{len(items)} {name.replace('_', ' ')}: {items[:5]}")
        if self.failed:
            out.append(f"failed jobs: {self.failed}")
        return out


def audit(c: Cluster, wl: Workload, out: Path, timeout: float = 120) -> Audit:
    """Wait for ``wl`` to finish, then check the ledger and ``tokenmill export`` row by row."""
    wanted = {prompt_key(row_messages(r)): r for r in wl.rows}
    client = c.client
    wait_finished(client, wl.run, len(wanted), timeout)
    a = Audit(prompts=len(wanted))
    _audit_ledger(client, wl, a)
    cli("export", "--run", wl.run, "--out", str(out), "--include-truncated", env=c.env)
    rows = read_export(out).get(wl.partition, [])
    a.exported = len(rows)
    seen: set[bytes] = set()
    for row in rows:
        key = prompt_key(row["messages"][:-1])
        if key in seen:
            a.duplicated.append(str(row["id"]))
            continue
        seen.add(key)
        if key not in wanted:
            a.duplicated.append(f"unexpected {row['id']}")
            continue
        want = expected_for(
            row, max_tokens=wl.max_tokens, reasoning=wl.reasoning, mean_output_tokens=wl.mean_output_tokens
        )
        got = row["messages"][-1]
        if (got["content"], got.get("reasoning_content"), row["finish_reason"]) != (
            want.content,
            want.reasoning_content,
            want.finish_reason,
        ):
            a.wrong_text.append(str(row["id"]))
        usage = row["usage"]
        if (usage["completion_tokens"], usage["prompt_tokens"]) != (want.completion_tokens, want.prompt_tokens):
            a.wrong_usage.append(
                f"{row['id']}: completion {usage['completion_tokens']} (want {want.completion_tokens}), "
                f"prompt {usage['prompt_tokens']} (want {want.prompt_tokens})"
            )
        a.kept_tokens += int(usage["completion_tokens"] or 0)
    failed_keys = a.failed and _failed_prompt_keys(client, wl)
    a.lost = [r["prompt"][:40] if "prompt" in r else "?" for k, r in wanted.items()
              if k not in seen and k not in (failed_keys or set())]  # fmt: skip
    return a


def _audit_ledger(client: redis.Redis, wl: Workload, a: Audit) -> None:
    k = keys.RunKeys(wl.run)
    ids = [x.decode() for x in client.lrange(k.jobs(wl.partition), 0, -1)]
    if len(ids) != len(set(ids)):
        a.ledger_problems.append(f"the jobs list holds {len(ids) - len(set(ids))} duplicate id(s)")
    if len(set(ids)) != a.prompts:
        a.ledger_problems.append(f"{len(set(ids))} jobs in the ledger for {a.prompts} distinct prompts")
    pipe = client.pipeline(transaction=False)
    for j in ids:
        pipe.hmget(k.job(j), ["state", "result", "error_class", "retries"])
    actual = dict.fromkeys(keys.STATES, 0)
    for state, result, error_class, retries in pipe.execute():
        s = (state or b"").decode()
        actual[s] = actual.get(s, 0) + 1
        a.retries += int(retries or 0)
        if s == "failed":
            cls = (error_class or b"?").decode()
            a.failed[cls] = a.failed.get(cls, 0) + 1
        elif s == "done" and result:
            res = orjson.loads(result)
            a.done += 1
            if res.get("continued_tokens"):
                a.continued_jobs += 1
                a.continued_tokens += int(res["continued_tokens"])
            a.restarted += bool(res.get("restarted"))
    counts = state_counts(client, wl.run)
    if {s: counts.get(s, 0) for s in keys.STATES} != {s: actual.get(s, 0) for s in keys.STATES}:
        a.ledger_problems.append(f"counts hash {counts} disagrees with the jobs' states {actual}")


def _failed_prompt_keys(client: redis.Redis, wl: Workload) -> set[bytes]:
    k = keys.RunKeys(wl.run)
    out = set()
    for j in all_job_ids(client, wl.run):
        state, spec = client.hmget(k.job(j), ["state", "spec"])
        if state == b"failed" and spec:
            out.add(prompt_key(orjson.loads(spec)["request"]["messages"]))
    return out


def queue_messages(client: redis.Redis, queue: str = "short") -> dict[str, int]:
    """Job id → how many messages for it wait in the broker list of ``queue``."""
    out: dict[str, int] = {}
    for raw in client.lrange(keys.broker_queue(queue), 0, -1):
        import base64

        body = orjson.loads(base64.b64decode(orjson.loads(raw)["body"]))
        job_id = body[0][2]
        out[job_id] = out.get(job_id, 0) + 1
    return out
