"""Scripts that cannot be poisoned: what the ledger's Lua scripts read (ARGV, stored counts, slot
leases) is clamped, so that no absurd value makes a script error half-way, drift a count, or stop
a server's admissions for every run (issue 53)."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
import redis

from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import Proc, start_sim, start_worker, wait_for, worker_env
from tests.test_admission import try_admit
from tests.test_ledger import build_spec
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.server_report import Load
from tokenmill.settings import Settings
from tokenmill.transitions import Claim, JobError, LengthReport
from workers.admission.limiter import Admission, output_tokens
from workers.admission.policy import SLOT_MAX

SLOTS, USED = keys.admission("srv"), keys.admission_used("srv")
HUGE = 18446744073709551615  # the max_tokens: 2**64 - 1
# what a stored value may hold: a huge double as Lua prints it, a drifted count, words, an int64
# past 2**53 (HINCRBY overflows it), a fraction, NaN and infinity as strtod reads them
GARBAGE = [
    "1.8446744073709552e+19",
    "-44",
    "abc",
    str(2**63 - 1),
    "-9223372036854775808",
    "0.5",
    "nan",
    "inf",
]
# every field of a server's used hash that admit.lua, unadmit.lua and the window rule read
FIELDS = (
    "total short long n n:short n:long unpaced tail window window_ms life_ms life_dev life_n pace_tat bound "
    "pace_open young_fit len_mean len_dev len_n wanted:short wanted:long srv_retractions hold_until refused "
    "refused_seen srv_waiting srv_running srv_used seen_each seen_rise seen_ms admitted start_admitted "
    "start_n use_sum use_n use_min paced_cap paced tailed backoffs"
).split()


def adm(rclient: redis.Redis, **kw: object) -> Admission:
    base = {"admission_fraction": 1.0, "admission_queue_share": 0.75}
    return Admission(rclient, Settings.load(env={}, **{**base, **kw}))


def now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return seconds * 1000 + micros // 1000


def in_flight(client: redis.Redis) -> dict[str, int]:
    """The used hash's counts of requests in flight, each as an integer (a float or a word fails)."""
    used = client.hgetall(USED)
    return {f: int(used.get(f.encode(), b"0")) for f in ("total", "short", "n", "n:short", "unpaced", "tail")}


def heartbeat(client: redis.Redis, member: str, tokens: object) -> None:
    """heartbeat.lua for a running job holding slot ``member`` of "srv", resized to ``tokens``."""
    k = keys.RunKeys("r")
    client.hset(k.job("j"), mapping={"state": "running", "token": "1"})
    keys_ = [k.job("j"), k.leases(), k.throughput(), SLOTS, USED, k.lengths()]
    client.register_script(t.script_source("heartbeat"))(
        keys_, ["j", "1", 30_000, 0, "", "", 0, 0, 0, member, tokens, "r0"]
    )


def test_a_huge_slot_that_expires_instead_of_being_released_leaves_the_server_admitting(
    rclient: redis.Redis,
) -> None:
    # Given a fresh window on the server, and the slot: a job of max_tokens 2**64 - 1 whose
    # worker died, so that its slot expires instead of being released (sent as is, past
    # Python's clamp, to show the script alone holds)
    rclient.hset(USED, mapping={"window": 4, "window_ms": now_ms(rclient)})
    dead = adm(rclient, lease_ttl_s=0.3)
    huge = try_admit(dead, "srv", 10_000, HUGE + 50, "short")
    assert huge is not None
    # and another run's ordinary request in flight beside it
    a = adm(rclient)
    other = try_admit(a, "srv", 10_000, 400, "short")
    assert other is not None
    # When the huge slot's lease expires
    wait_for(lambda: rclient.zscore(SLOTS, huge.member) < now_ms(rclient), 5, "the huge slot's lease expired")
    # Then ordinary requests are admitted after it, again and again (no script errors), and the
    # counts hold exactly what is in flight: nothing drifted below zero
    assert try_admit(a, "srv", 10_000, 300, "short") is not None
    assert in_flight(rclient) == {"total": 700, "short": 700, "n": 2, "n:short": 2, "unpaced": 2, "tail": 0}
    a.release(other)
    assert try_admit(a, "srv", 10_000, 100, "short") is not None
    assert in_flight(rclient) == {"total": 400, "short": 400, "n": 2, "n:short": 2, "unpaced": 2, "tail": 0}


@pytest.mark.parametrize("value", GARBAGE)
def test_garbage_in_a_servers_admission_hash_stops_no_script_and_heals_once_nothing_is_in_flight(
    rclient: redis.Redis, value: str
) -> None:
    # Given every field the admission scripts read holding garbage, a slot whose lease is set
    # absurdly far ahead (it would never expire) and an expired one of a garbage size
    rclient.hset(USED, mapping=dict.fromkeys(FIELDS, value))
    rclient.zadd(SLOTS, {"ghost": 2**62, "old": 1})
    rclient.hset(
        USED, mapping={"slot:ghost": value, "slotq:ghost": "short", "up:ghost": 1, "slot:old": value}
    )
    a = adm(rclient)
    # When the watcher steers the window, and requests are admitted, resized and given back
    assert a.adapt("srv", Load(1, 0, 500, 10_000), 3) >= 2
    first = try_admit(a, "srv", 10_000, 400, "short")
    assert first is not None  # nothing was really in flight: the garbage counts were healed
    heartbeat(rclient, first.member, 600)
    second = try_admit(a, "srv", 10_000, 100, "short")
    a.adapt("srv", Load(2, 0, 700, 10_000), 3)
    # Then every count is an integer holding what is in flight, and stays so as slots go back
    assert set(rclient.zrange(SLOTS, 0, -1)) == {s.member.encode() for s in (first, second) if s}
    held = 600 + (100 if second else 0)
    n = 2 if second else 1
    assert in_flight(rclient) == {"total": held, "short": held, "n": n, "n:short": n, "unpaced": n, "tail": 0}
    a.release(first)
    if second:
        a.release(second)
    assert in_flight(rclient) == {"total": 0, "short": 0, "n": 0, "n:short": 0, "unpaced": 0, "tail": 0}
    assert try_admit(a, "srv", 10_000, 400, "short") is not None


@pytest.mark.parametrize("tokens", [str(HUGE), "1.8446744073709552e+19", "-5", "abc", "0.5", "nan", "inf"])
def test_absurd_figures_passed_to_the_scripts_are_clamped_not_errors(
    rclient: redis.Redis, tokens: str
) -> None:
    a = adm(rclient)
    # Given an admission whose size, budget and lease are absurd
    req = a.request("srv", 10_000, 1, "short")
    assert req is not None
    args = [req.args[0], tokens, "short", "inf", "nan", "-1", *req.args[6:]]
    # When it is admitted, resized by its heartbeat to another absurd size, the watcher reports
    # absurd figures, and the slot is given back with an absurd output length
    assert rclient.register_script(t.script_source("admit"))(list(req.keys), args) == 1
    heartbeat(rclient, req.args[0], tokens)
    a.adapt("srv", Load(math.nan, -3, 1e300, math.inf), 10**400)  # type: ignore[arg-type]
    assert rclient.register_script(t.script_source("unadmit"))(list(req.keys), [req.args[0], "1e300"]) == 1
    # Then nothing is left counted, and the server admits ordinary requests
    assert in_flight(rclient) == {"total": 0, "short": 0, "n": 0, "n:short": 0, "unpaced": 0, "tail": 0}
    assert try_admit(a, "srv", 10_000, 400, "short") is not None
    assert in_flight(rclient)["total"] == 400


@pytest.mark.parametrize("value", GARBAGE)
def test_garbage_in_a_runs_counts_and_totals_stops_none_of_its_transitions(
    rclient: redis.Redis, value: str
) -> None:
    # Given a run's counts, totals, failures, lengths and outputs holding garbage, and a job's
    # own token, attempts, lease and checkpoint sizes too
    ledger, k = Ledger(rclient, "r"), keys.RunKeys("r")
    request = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10}
    jobs = [
        build_spec(
            partition="P", queue="short", source=f"f:{i}", request=request, metadata={}, record_id=str(i)
        )
        for i in range(2)
    ]
    ledger.call(t.enqueue(ledger.k, "P", jobs, 100))
    for key, fields in (
        (k.counts(), ("queued|P", "running|P", "done|P", "failed|P")),
        (k.stats(), ("completion_tokens", "prompt_tokens", "truncated")),
        (k.failures(), ("terminal",)),
        (k.lengths(), ("r0", "e0")),
        (k.outputs(), ("finish:stop",)),
    ):
        rclient.hset(key, mapping=dict.fromkeys(fields, value))
    rclient.hset(
        k.job(jobs[0].job_id),
        mapping={
            "token": value,
            "attempts": value,
            "lease": value,
            "ckpt_tokens": value,
            "ckpt_prompt": value,
        },
    )
    # When one job is claimed, heartbeats, is released, claimed again and committed, and the
    # other fails
    c = ledger.call(t.claim(ledger.k, jobs[0].job_id, "w", 30))
    assert isinstance(c, Claim), c
    assert ledger.call(t.heartbeat(t.Beat(c, None, 3), 30))
    assert (
        ledger.call(t.release(ledger.k, c, JobError("stall", "x"), delay_s=0, burn=True, max_attempts=5))
        == "queued"
    )
    c = ledger.call(t.claim(ledger.k, jobs[0].job_id, "w", 30))
    assert isinstance(c, Claim), c
    lengths = LengthReport(reached=(0,), ended=0, prompt=(5, 7))
    assert (
        ledger.call(t.commit(ledger.k, c, {"content": "ok", "usage": {"completion_tokens": 3}}, 3, lengths))
        == "ok"
    )
    other = ledger.call(t.claim(ledger.k, jobs[1].job_id, "w", 30))
    assert (
        isinstance(other, Claim) and ledger.call(t.fail(ledger.k, other, JobError("terminal", "bad"))) == "ok"
    )
    # Then each ended where it should, and every count it moved is an integer again
    assert [ledger.job(j.job_id)["state"] for j in jobs] == ["done", "failed"]
    moved = [*rclient.hvals(k.counts()), *rclient.hmget(k.stats(), "completion_tokens", "prompt_tokens")]
    assert all(int(v) >= 0 for v in [*moved, rclient.hget(k.failures(), "terminal")]), moved
    assert rclient.hmget(k.lengths(), "pn", "pe", "pk") == [b"1", b"5", b"7"]


def test_a_request_is_sized_within_what_the_scripts_count_whatever_its_max_tokens(
    rclient: redis.Redis,
) -> None:
    a = adm(rclient, admission_default_output_tokens=1000)
    messages = [{"role": "user", "content": "hello"}]
    # Given the max_tokens, and values no server takes
    assert a.held("r", {"messages": messages, "max_tokens": HUGE}, 0) == SLOT_MAX
    assert output_tokens(float("inf"), 1000) == SLOT_MAX
    for bad in (None, 0, -5, "abc", float("nan"), True, [1]):
        assert output_tokens(bad, 1000) == 1000, bad
    assert output_tokens(100.7, 1000) == 100


def test_a_job_too_big_for_its_server_fails_alone_and_the_rest_of_the_run_is_done(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a run of 7 prompts on a sim whose context holds 2,000 tokens, one of them asking for
    # the max_tokens (written into its stored spec: enqueue's bounds are not relied on)
    sim, url = start_sim(tmp_path, "--context-length", "2000")
    procs.append(sim)
    env = worker_env(redis_url, url)
    rows = [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(7)]
    cli(
        "enqueue",
        str(write_jsonl(tmp_path / "P.jsonl", rows)),
        "--run",
        "r",
        "--short-max-tokens",
        "40",
        env=env,
    )
    job = keys.RunKeys("r").job("P:q3")
    spec = orjson.loads(rclient.hget(job, "spec"))
    spec["request"]["max_tokens"] = HUGE
    rclient.hset(job, "spec", orjson.dumps(spec))
    # When a worker runs it
    procs.append(start_worker(tmp_path, "short", env, concurrency=4))
    doc = wait_run_finished(rclient, "r", 60)
    # Then that job alone failed, with the server's answer, and the others are done; the server's
    # admission counts are back to nothing in flight
    assert doc["totals"]["done"] == 6 and doc["failures"] == {"context_length": 1}
    failed = rclient.hgetall(job)
    assert failed[b"state"] == b"failed" and b"Requested token count" in failed[b"error"], failed
    used = [rclient.hmget(k, "n", "total") for k in rclient.scan_iter(keys.admission_used("*"))]
    assert used and all(counts == [b"0", b"0"] for counts in used), used
