"""Quality while a run runs (issue 56): the ledger's counts, windows and stop rules, the pause
and its lifting, on a real redis-server; then end to end with real ``celery worker`` processes
and the sim: a rule that trips pauses the run with every job accounted for, the pause outlives
worker and Redis restarts, and ``resume`` finishes the run exactly once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from producer.metrics import registry_for
from producer.pause import encode_rules, lift, pause_run, store_rules
from producer.resume import resume_run
from producer.status import run_status
from tests.pipeline import cli, read_export, write_jsonl
from tests.procs import Proc, RedisServer, start_sim, start_worker, wait_for, worker_env
from tests.test_ledger import spec
from tests.test_sim_quality_faults import KINDS, MAX_TOKENS, fault
from tests.test_start_finish import SERVER, admission, used
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.errors import ConfigError
from tokenmill.ledger import Ledger
from tokenmill.quality import EMPTY, LENGTH, REPETITION
from tokenmill.replies import text
from tokenmill.settings import Settings
from tokenmill.transitions import Claim, Judged
from workers.upkeep import Reconciler, upkeep_once

RUN = "q"
K = keys.RunKeys(RUN)


def commit(ledger: Ledger, job_id: str, mask: int, window: int = 4) -> str:
    """Claim ``job_id`` and commit it judged with ``mask``."""
    c = ledger.call(t.claim(ledger.k, job_id, "w", 30))
    assert isinstance(c, Claim), c
    return ledger.call(
        t.commit(
            ledger.k, c, {"content": "x", "usage": {"completion_tokens": 1}}, 1, judged=Judged(mask, window)
        )
    )


def enqueued(ledger: Ledger, partition: str, n: int) -> list[str]:
    jobs = [spec(i, partition=partition, record_id=str(i)) for i in range(n)]
    ledger.call(t.enqueue(ledger.k, partition, jobs, 1000))
    return [j.job_id for j in jobs]


def hash_of(client: redis.Redis, key: str) -> dict[str, str]:
    return {text(a): text(b) for a, b in client.hgetall(key).items()}


def metrics(client: redis.Redis) -> dict[tuple[str, tuple[str, ...]], float]:
    """The exporter's samples: (name, (run, partition, signal) as labelled) → value."""
    text_ = generate_latest(registry_for(client)).decode()
    return {
        (s.name, tuple(s.labels[k] for k in ("run", "partition", "signal") if k in s.labels)): s.value
        for f in text_string_to_metric_families(text_)
        for s in f.samples
    }


def window(client: redis.Redis, partition: str) -> list[int]:
    return [int(x) for x in client.lrange(K.quality_window(partition), 0, -1)]


def test_commit_counts_each_flag_and_the_window_keeps_the_latest_masks(rclient: redis.Redis) -> None:
    ledger = Ledger(rclient, RUN)
    ids = enqueued(ledger, "A", 6)
    # When five jobs commit with these flags, in a window of 3
    for job_id, mask in zip(ids, [LENGTH, 0, LENGTH | EMPTY, REPETITION, 0], strict=False):
        assert commit(ledger, job_id, mask, window=3) == "ok"
    # Then the run's counts hold all five; the window the last three, and its counts theirs
    assert hash_of(rclient, K.quality()) == {
        "A|judged": "5",
        "A|length": "2",
        "A|empty": "1",
        "A|repetition": "1",
    }
    assert window(rclient, "A") == [0, REPETITION, LENGTH | EMPTY]
    assert hash_of(rclient, K.quality_window_counts()) == {
        "A|n": "5", "A|length": "1", "A|empty": "1", "A|repetition": "1"
    }  # fmt: skip
    # the latest jobs of each flag, newest first, for the dashboard's worst examples
    assert rclient.lrange(K.quality_worst("length"), 0, -1) == [
        f"A|{ids[2]}".encode(),
        f"A|{ids[0]}".encode(),
    ]
    # When one more clean job commits, the looping one is still in the window, the others left
    commit(ledger, ids[5], 0, window=3)
    counts = hash_of(rclient, K.quality_window_counts())
    assert (counts["A|length"], counts["A|empty"], counts["A|repetition"], counts["A|n"]) == (
        "0",
        "0",
        "1",
        "6",
    )
    # and status reads the rates over the window, the run's judged jobs since it began
    doc = run_status(rclient, RUN)
    q = doc["partitions"]["A"]["quality"]
    assert (q["judged"], q["window"], q["repetition"], q["length_share"]) == (6, 3, round(1 / 3, 4), 0.0)
    assert doc["quality"]["judged"] == 6 and doc["paused"] is None
    # and so do the metrics: counters since the run began, gauges over the window
    m = metrics(rclient)
    assert m["tokenmill_quality_judged_total", (RUN, "A")] == 6
    assert m["tokenmill_quality_flagged_total", (RUN, "A", "length")] == 2
    assert m["tokenmill_quality_rate", (RUN, "A", "repetition")] == round(1 / 3, 4)
    assert m["tokenmill_run_paused", (RUN,)] == 0
    # a commit that is not judged (quality off) counts nothing
    c = ledger.call(t.claim(ledger.k, enqueued(ledger, "A", 7)[6], "w", 30))
    assert (
        isinstance(c, Claim) and ledger.call(t.commit(ledger.k, c, {"content": "z", "usage": {}}, 0)) == "ok"
    )
    assert hash_of(rclient, K.quality())["A|judged"] == "6" and window(rclient, "A")[0] == 0


def test_a_rule_trips_at_its_threshold_after_its_minimum_jobs_on_its_partition_alone(
    rclient: redis.Redis,
) -> None:
    ledger = Ledger(rclient, RUN)
    store_rules(rclient, RUN, encode_rules(["length_share>0.5@4", "empty_share<0.1@100"]), {})
    a, b = enqueued(ledger, "A", 8), enqueued(ledger, "B", 4)
    # B's three jobs all end at max_tokens: a rate of 1, but fewer than @4 jobs
    for job_id in b[:3]:
        commit(ledger, job_id, LENGTH)
    assert not rclient.exists(K.paused())
    b_running = ledger.call(t.claim(ledger.k, b[3], "w", 30))
    assert isinstance(b_running, Claim)
    # A's window slides over L 0 L 0 L: at 0.5, exactly the bound, it does not trip (and the run's
    # rate over both partitions, 5 of 8, does not count)
    for job_id, mask in zip(a, [LENGTH, 0, LENGTH, 0, LENGTH], strict=False):
        commit(ledger, job_id, mask)
        assert not rclient.exists(K.paused()), mask
    # When the next job of A ends at max_tokens: 3 of its last 4
    commit(ledger, a[5], LENGTH)
    # Then the run is paused by the rule, with the reason
    paused = hash_of(rclient, K.paused())
    assert paused["by"] == "rule"
    assert paused["reason"] == "quality rule length_share>0.5@4 tripped on partition A: 0.750 over 4 jobs"
    # and once only: B's trip (its running job's commit) and a person's pause keep the first pause
    assert (
        ledger.call(t.commit(ledger.k, b_running, {"content": "x", "usage": {}}, 0, judged=Judged(LENGTH, 4)))
        == "ok"
    )
    assert hash_of(rclient, K.quality_window_counts())["B|n"] == "4"
    assert pause_run(ledger, "by hand") == (False, paused)
    assert hash_of(rclient, K.paused()) == paused
    assert metrics(rclient)["tokenmill_run_paused", (RUN,)] == 1
    assert run_status(rclient, RUN)["paused"] == {
        "reason": paused["reason"], "at": int(paused["at_ms"]) / 1000, "by": "rule"
    }  # fmt: skip


def test_a_below_rule_trips_when_the_rate_falls_under_its_bound(rclient: redis.Redis) -> None:
    ledger = Ledger(rclient, RUN)
    store_rules(rclient, RUN, encode_rules(["empty_share < 0.5 @ 2"]), {})
    ids = enqueued(ledger, "A", 3)
    commit(ledger, ids[0], EMPTY)
    commit(ledger, ids[1], 0)  # 0.5: not below
    assert not rclient.exists(K.paused())
    commit(ledger, ids[2], 0)
    assert (
        "empty_share < 0.5 @ 2 tripped on partition A: 0.333 over 3 jobs"
        in hash_of(rclient, K.paused())["reason"]
    )


def test_a_paused_run_claims_nothing_its_running_jobs_commit_and_resume_rearms_its_rules(
    rclient: redis.Redis,
) -> None:
    ledger, adm = Ledger(rclient, RUN), admission(rclient)
    store_rules(rclient, RUN, encode_rules(["repetition>0.5@2"]), {})
    ids = enqueued(ledger, "A", 8)
    running = ledger.call(t.claim(ledger.k, ids[0], "w", 30))
    assert isinstance(running, Claim)
    commit(ledger, ids[1], REPETITION)
    commit(ledger, ids[2], REPETITION)
    assert hash_of(rclient, K.paused())["by"] == "rule"
    # When a worker tries to claim a job of the paused run, alone or with admission
    assert ledger.call(t.claim(ledger.k, ids[3], "w", 30)) == "paused"
    req = adm.request(SERVER, 1000, 100, "short")
    assert req is not None
    assert ledger.call(t.start(ledger.k, ids[3], "w", 30, req)) == "paused"
    # Then nothing is claimed or admitted: the job stays queued
    assert ledger.job(ids[3])["state"] == "queued" and "attempts" not in ledger.job(ids[3])
    assert ledger.counts()["A"] == {"queued": 5, "running": 1, "done": 2, "failed": 0}
    assert used(rclient).get("n", "0") == "0"
    # a done job still says done, and the job that was running finishes
    assert ledger.call(t.claim(ledger.k, ids[1], "w", 30)) == "done"
    assert (
        ledger.call(
            t.commit(ledger.k, running, {"content": "y", "usage": {}}, 0, judged=Judged(REPETITION, 4))
        )
        == "ok"
    )
    rclient.hset(K.quality_reference(), mapping={"url": "http://ref", "A|n": 3, "A|sum": 0.9, "A|sumsq": 0.3})
    # When the run is resumed
    summary = resume_run(rclient, RUN, 100)
    # Then the pause is lifted, the windows are cleared (the counts since the run began stay)
    assert summary.unpaused.startswith("quality rule repetition>0.5@2 tripped on partition A")
    assert "pause lifted (quality rule" in summary.line(RUN)
    assert not rclient.exists(K.paused()) and window(rclient, "A") == []
    assert hash_of(rclient, K.quality_window_counts()) == {}
    assert hash_of(rclient, K.quality())["A|repetition"] == "3"
    assert hash_of(rclient, K.quality_reference()) == {"url": "http://ref"}  # drift rules count again too
    # and the rule counts from zero: one looping job is not yet @2
    assert isinstance(ledger.call(t.claim(ledger.k, ids[3], "w", 30)), Claim)
    commit(ledger, ids[4], REPETITION)
    assert not rclient.exists(K.paused())
    commit(ledger, ids[5], REPETITION)
    assert hash_of(rclient, K.paused())["reason"].endswith("1.000 over 2 jobs")
    assert lift(ledger).endswith("1.000 over 2 jobs") and lift(ledger) == ""


def test_the_upkeep_publishes_nothing_for_a_paused_run(rclient: redis.Redis) -> None:
    ledger = Ledger(rclient, RUN)
    ids = enqueued(ledger, "A", 3)
    rclient.delete(keys.broker_queue("short"))  # the messages were delivered and acked (paused)
    pause_run(ledger, None)
    settings = Settings.load(env={})
    reconciler = Reconciler()
    # When the upkeep passes (the reconciler needs two passes to republish an orphan)
    for _ in range(3):
        did = upkeep_once(rclient, settings, reconciler)
        assert did["republished"] == 0
    assert rclient.llen(keys.broker_queue("short")) == 0
    # Then once the pause is lifted, the orphans are republished
    lift(ledger)
    upkeep_once(rclient, settings, reconciler)
    assert upkeep_once(rclient, settings, reconciler)["republished"] == len(ids)


@pytest.mark.parametrize(
    ("expr", "said"),
    [
        ("repetiton>0.05", "unknown signal 'repetiton'"),
        ("length_share=0.3", "write NAME>VALUE or NAME<VALUE"),
        ("length_share>abc@10", "the value 'abc' is not a number"),
        ("length_share>0.3@0", "must be a positive whole number, got '0'"),
    ],
)
def test_a_bad_rule_names_itself_and_nothing_is_enqueued(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, expr: str, said: str
) -> None:
    data = write_jsonl(tmp_path / "P.jsonl", [{"prompt": "hi"}])
    env = {"TOKENMILL_REDIS_URL": redis_url}
    bad = cli("enqueue", str(data), "--run", RUN, "--quality-stop", "empty_share>0.5", "--quality-stop", expr,
              env=env, check=False)  # fmt: skip
    assert bad.returncode == 2 and f"quality rule {expr!r}" in bad.stderr and said in bad.stderr, bad.stderr
    assert rclient.keys("*") == []
    # the default from the setting is checked as strictly
    env["TOKENMILL_QUALITY_STOP"] = f"empty_share>0.5;{expr}"
    bad = cli("enqueue", str(data), "--run", RUN, env=env, check=False)
    assert bad.returncode == 2 and f"quality rule {expr!r}" in bad.stderr and rclient.keys("*") == []


def test_rules_given_replace_the_default_and_the_default_applies_once(rclient: redis.Redis) -> None:
    with pytest.raises(ConfigError, match="unknown signal 'nope'"):
        encode_rules(["nope>1"])
    default = encode_rules(["length_share>0.3@200"])
    store_rules(rclient, RUN, {}, default)
    store_rules(rclient, RUN, {}, encode_rules(["empty_share>0.1"]))  # the run has rules already
    assert hash_of(rclient, K.quality_rules()) == {"length_share>0.3@200": "> 0.3 200 length_share"}
    store_rules(rclient, "other", encode_rules(["drift>0.5@100"]), default)
    assert hash_of(rclient, keys.RunKeys("other").quality_rules()) == {"drift>0.5@100": "> 0.5 100 drift"}


# -- end to end: real workers, the sim ---------------------------------------------------------


def _status(env: dict[str, str], run: str) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(cli("status", "--run", run, "--json", env=env).stdout)
    return doc


def _accounted(rclient: redis.Redis, run: str, total: int) -> dict[str, int]:
    t: dict[str, int] = run_status(rclient, run)["totals"]
    assert t["total"] == total and t["done"] + t["queued"] + t["running"] == total, t
    return t


def test_a_tripped_rule_pauses_the_run_which_outlives_restarts_and_resumes_exactly_once(
    tmp_path: Path, redis_server: RedisServer, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given 120 jobs whose every output ends at max_tokens (4 tokens of the sim's ~40), a rule
    # that stops the run once half of a partition's last jobs do, after 20, and 2 workers of 4
    sim, url = start_sim(tmp_path)
    procs.append(sim)
    env = worker_env(redis_url, url)
    rows = [{"id": str(i), "prompt": f"question {i}"} for i in range(120)]
    data = write_jsonl(tmp_path / "P.jsonl", rows)
    rule = "length_share>0.5@20"
    cli("enqueue", str(data), "--run", "r", "--short-max-tokens", "4", "--quality-stop", rule, env=env)
    workers = [start_worker(tmp_path, "short", env, concurrency=4) for _ in range(2)]
    procs.extend(workers)
    # When the run has run: it pauses by the rule, and its running jobs finish
    wait_for(lambda: rclient.exists(keys.RunKeys("r").paused()), 60, "the rule to pause the run")
    t = wait_for(
        lambda: (t := _accounted(rclient, "r", 120))["running"] == 0 and t, 30, "running jobs to end"
    )
    # Then it stopped within the rule's 20 jobs and what 8 streams had in flight (none lost)
    assert 20 <= t["done"] <= 20 + 8 and t["queued"] == 120 - t["done"], t
    doc = _status(env, "r")
    assert doc["paused"]["by"] == "rule" and doc["paused"]["at"] > 0
    assert doc["paused"]["reason"].startswith(
        "quality rule length_share>0.5@20 tripped on partition P: 1.000 over"
    )
    assert doc["quality"]["length_share"] == 1.0 and doc["quality"]["judged"] == t["done"]
    assert doc["partitions"]["P"]["quality"]["empty_share"] == 0.0
    human = cli("status", "--run", "r", env={**env, "COLUMNS": "250"}).stdout
    assert "PAUSED since" in human and "by rule: quality rule length_share>0.5@20" in human
    assert f"quality P: {t['done']} judged" in human and "length_share 100.0%" in human
    assert any("run r is paused (quality rule" in w.output() for w in workers)

    # When both workers restart and Redis restarts (AOF), and every queued job is delivered again
    for w in workers:
        w.stop()
    redis_server.restart()
    wait_for(lambda: rclient.ping(), 10, "Redis back")
    workers = [start_worker(tmp_path, "short", env, concurrency=4) for _ in range(2)]
    procs.extend(workers)
    assert Ledger(rclient, "r").republish([f"P:{i}" for i in range(120)]).published == 120 - t["done"]
    # Then the workers take the messages, claim nothing and say why; the run stays as it was
    wait_for(
        lambda: rclient.llen("short") == 0 and not rclient.hlen("unacked"), 30, "the messages to be acked"
    )
    wait_for(
        lambda: any("run r is paused" in w.output() for w in workers), 10, "a restarted worker to say so"
    )
    assert _accounted(rclient, "r", 120) == t and _status(env, "r")["paused"] == doc["paused"]

    # When it is resumed
    out = cli("resume", "--run", "r", env=env).stdout
    assert "pause lifted (quality rule length_share>0.5@20" in out
    # Then it runs again until the rule, re-armed, trips once more after 20 new jobs
    wait_for(lambda: rclient.exists(keys.RunKeys("r").paused()), 60, "the re-armed rule to trip")
    t2 = wait_for(
        lambda: (x := _accounted(rclient, "r", 120))["running"] == 0 and x, 30, "running jobs to end"
    )
    assert t["done"] + 20 <= t2["done"] <= t["done"] + 28
    # and with the rule's bound raised above what this run does, resume finishes it, each job once
    rclient.delete(keys.RunKeys("r").quality_rules())
    cli("resume", "--run", "r", env=env)
    wait_for(lambda: _accounted(rclient, "r", 120)["done"] == 120, 60, "the run to finish")
    cli("export", "--run", "r", "--out", str(tmp_path / "out"), "--include-truncated", env=env)
    ids = [row["id"] for row in read_export(tmp_path / "out")["P"]]
    assert sorted(ids, key=int) == [str(i) for i in range(120)]
    attempts = [int(Ledger(rclient, "r").job(f"P:{i}")["attempts"]) for i in range(120)]
    assert attempts == [1] * 120  # refused claims took no attempt: each job ran once


def test_pause_and_resume_by_hand(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a run of 40 slow jobs (about 1 s each) on a worker of 4 streams
    sim, url = start_sim(tmp_path, "--sim-step-ms", "25")
    procs.append(sim)
    env = worker_env(redis_url, url)
    data = write_jsonl(tmp_path / "H.jsonl", [{"id": str(i), "prompt": f"q {i}"} for i in range(40)])
    cli("enqueue", str(data), "--run", "h", "--short-max-tokens", "40", env=env)
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    wait_for(lambda: run_status(rclient, "h")["totals"]["done"] >= 4, 60, "some jobs done")
    # When a person pauses it
    out = cli("pause", "--run", "h", "--reason", "checking the template", env=env).stdout
    assert "run h: paused: checking the template; running jobs finish" in out
    # Then its running jobs finish and nothing more is claimed
    t = wait_for(lambda: (x := _accounted(rclient, "h", 40))["running"] == 0 and x, 30, "running jobs to end")
    assert t["done"] < 40
    assert _status(env, "h")["paused"]["reason"] == "checking the template"
    again = cli("pause", "--run", "h", env=env).stdout
    assert "already paused by person: checking the template" in again
    bad = cli("pause", "--run", "nope", env=env, check=False)
    assert bad.returncode == 2 and "--run 'nope': no run of that name" in bad.stderr
    # When it is resumed, it finishes
    assert "pause lifted (checking the template)" in cli("resume", "--run", "h", env=env).stdout
    wait_for(lambda: _accounted(rclient, "h", 40)["done"] == 40, 60, "the run to finish")
    assert _status(env, "h")["paused"] is None


# -- the sim degraded mid-run (its POST /_sim/fault {"degrade": ...}) ---------------------------

FAULT_RULES = {  # the degraded mode, the rows it degrades, the rule its signal trips
    "loop": ("text", "repetition>0.3@20"),
    "truncate": ("text", "length_share>0.5@20"),
    "empty": ("text", "empty_share>0.5@20"),
    "broken_json": ("json_schema", "invalid_structured>0.3@20"),
    "broken_tools": ("tools", "tool_call_errors>0.3@20"),
}
WINDOW = 20  # the workers' quality_window_jobs: a rule at 0.5 trips on the 11th degraded job


def _quality_sim(tmp_path: Path, procs: list[Proc], seed: int = 0) -> str:
    sim, url = start_sim(tmp_path, "--sim-seed", str(seed), "--tool-call-parser", "qwen25",
                         "--reasoning-parser", "qwen3")  # fmt: skip
    procs.append(sim)
    return url


def _rows(kind: str, n: int, tag: str) -> list[dict[str, Any]]:
    return [{"id": str(i), "prompt": f"{tag} {i}: what does a {kind} answer look like?", **KINDS[kind]}
            for i in range(n)]  # fmt: skip


def _degrade_mid_run(tmp_path: Path, rclient: redis.Redis, env: dict[str, str], url: str, mode: str) -> None:
    """A run of 120 jobs with the rule of ``mode``'s signal; the server degrades once the rule
    may trip: it trips within a bounded number of jobs, every job accounted for."""
    kind, rule = FAULT_RULES[mode]
    run = f"f-{mode.replace('_', '-')}"
    (tmp_path / mode).mkdir()
    data = write_jsonl(tmp_path / mode / f"{kind}.jsonl", _rows(kind, 120, mode))
    cli("enqueue", str(data), "--run", run, "--short-max-tokens", str(MAX_TOKENS), "--quality-stop", rule,
        env=env)  # fmt: skip
    wait_for(lambda: run_status(rclient, run)["totals"]["done"] >= WINDOW + 5, 60, f"{run}: healthy jobs")
    assert not rclient.exists(keys.RunKeys(run).paused()), f"{run}: tripped while healthy"
    # When the server degrades mid-run
    done0 = run_status(rclient, run)["totals"]["done"]
    assert fault(url, {"degrade": mode.replace("broken_tools", "broken_json")})[0] == 200
    # Then the rule trips: the run pauses, every job accounted for, within the jobs the window
    # needs (11 at most), those in flight at the switch and those in flight at the trip
    try:
        wait_for(lambda: rclient.exists(keys.RunKeys(run).paused()), 60, f"{run}: the rule to trip")
        t = wait_for(lambda: (x := _accounted(rclient, run, 120))["running"] == 0 and x, 30, f"{run}: idle")
    finally:
        fault(url, {"degrade": None})
    assert t["done"] - done0 <= 30, (run, done0, t)
    doc = run_status(rclient, run)
    reason = doc["paused"]["reason"]
    assert reason.startswith(f"quality rule {rule} tripped on partition {kind}: "), reason
    name, bound = rule.split("@")[0].split(">")
    assert doc["partitions"][kind]["quality"][name] > float(bound)


def test_a_degraded_server_trips_each_signals_rule_within_a_bounded_number_of_jobs(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    url = _quality_sim(tmp_path, procs)
    env = worker_env(redis_url, url, quality_window_jobs=WINDOW)
    procs.append(start_worker(tmp_path, "short", env, concurrency=8))
    for mode in FAULT_RULES:
        _degrade_mid_run(tmp_path, rclient, env, url, mode)
    # When the server is healthy again and a paused run is resumed, it finishes, each job once
    cli("resume", "--run", "f-loop", env=env)
    wait_for(lambda: _accounted(rclient, "f-loop", 120)["done"] == 120, 60, "f-loop to finish")
    assert run_status(rclient, "f-loop")["paused"] is None
    assert [int(Ledger(rclient, "f-loop").job(f"text:{i}")["attempts"]) for i in range(120)] == [1] * 120


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_run_with_every_rule_never_trips(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc], seed: int
) -> None:
    url = _quality_sim(tmp_path, procs, seed)
    env = worker_env(redis_url, url, quality_window_jobs=WINDOW)
    files = [str(write_jsonl(tmp_path / f"{kind.replace(', ', '-')}.jsonl", _rows(kind, 40, f"s{seed}")))
             for kind in KINDS]  # fmt: skip
    rules = [arg for _, rule in FAULT_RULES.values() for arg in ("--quality-stop", rule)]
    cli("enqueue", *files, "--run", "h", "--short-max-tokens", str(MAX_TOKENS), *rules, env=env)
    procs.append(start_worker(tmp_path, "short", env, concurrency=8))
    wait_for(
        lambda: _accounted(rclient, "h", 40 * len(KINDS))["done"] == 40 * len(KINDS), 90, "the run to end"
    )
    doc = run_status(rclient, "h")
    assert doc["paused"] is None and doc["quality"]["judged"] == 40 * len(KINDS)
    # nothing flagged but a few lengths outside the run's own p1..p99 (by their definition)
    assert {
        r: v for r, v in doc["quality"].items() if r not in ("judged", "window", "length_drift") and v
    } == {}
    assert doc["quality"]["length_drift"] <= 0.05
