"""``start.lua`` (admission + claim) and ``finish.lua`` (commit + unadmit): each outcome's
states on a real redis-server, against what the separate scripts do."""

from __future__ import annotations

import redis

from tests.test_admission import spread_in_flight
from tests.test_ledger import counts, spec
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.ledger import Ledger
from tokenmill.settings import Settings
from tokenmill.transitions import Claim, Full, JobError
from workers.admission.limiter import Admission

RUN = "sf"
SERVER = "srv"


def admission(rclient: redis.Redis) -> Admission:
    return Admission(rclient, Settings.load(env={}, admission_fraction=1.0, admission_queue_share=1.0))


def used(rclient: redis.Redis) -> dict[str, str]:
    raw = rclient.hgetall(keys.admission_used(SERVER))
    return {k.decode(): v.decode() for k, v in raw.items()}


def slots(rclient: redis.Redis) -> list[str]:
    return [m.decode() for m in rclient.zrange(keys.admission(SERVER), 0, -1)]


def test_start_admits_claims_and_drops_the_waiting_lease_in_one_call(rclient: redis.Redis) -> None:
    ledger, adm = Ledger(rclient, RUN), admission(rclient)
    job = spec(1)
    ledger.call(t.enqueue(ledger.k, "P", [job], 100))
    ledger.call(t.wait(ledger.k, job.job_id, 30))
    req = adm.request(SERVER, 1000, 400, "short")
    assert req is not None

    claim = ledger.call(t.start(ledger.k, job.job_id, "w1", 30, req))

    assert isinstance(claim, Claim) and claim.attempt == 1
    assert claim.spec["request"]["messages"][0]["content"] == "q1"
    assert claim.slot == (keys.admission(SERVER), keys.admission_used(SERVER), req.args[0])
    assert counts(ledger) == {"queued": 0, "running": 1, "done": 0, "failed": 0}
    assert ledger.job(job.job_id)["worker"] == "w1"
    assert slots(rclient) == [req.args[0]]
    u = used(rclient)
    assert (u["total"], u["n"], u[f"slot:{req.args[0]}"]) == ("400", "1", "400")
    assert rclient.zscore(keys.RunKeys(RUN).waiting(), job.job_id) is None
    # the heartbeat renews the slot the claim carries, as it does for a separately admitted one
    assert ledger.call(t.heartbeat(t.Beat(claim, None, 0), 30))


def test_start_without_room_claims_nothing_and_keeps_the_waiting_lease(rclient: redis.Redis) -> None:
    ledger, adm = Ledger(rclient, RUN), admission(rclient)
    a, b = spec(1), spec(2)
    ledger.call(t.enqueue(ledger.k, "P", [a, b], 100))
    first = adm.request(SERVER, 1000, 900, "short")
    assert first is not None and isinstance(ledger.call(t.start(ledger.k, a.job_id, "w1", 30, first)), Claim)
    ledger.call(t.wait(ledger.k, b.job_id, 30))
    second = adm.request(SERVER, 1000, 500, "short")
    assert second is not None

    assert ledger.call(t.start(ledger.k, b.job_id, "w1", 30, second)) == Full(0.0)

    assert ledger.job(b.job_id)["state"] == "queued" and "token" not in ledger.job(b.job_id)
    assert counts(ledger)["queued"] == 1 and counts(ledger)["running"] == 1
    assert slots(rclient) == [first.args[0]] and used(rclient)["refused"] == "1"
    assert rclient.zscore(keys.RunKeys(RUN).waiting(), b.job_id) is not None


def test_a_paced_refusal_says_when_the_next_start_is_due(rclient: redis.Redis) -> None:
    # Given a fresh window of 10 on a pool that binds, its requests living 10 s: a start a second,
    # in groups of two
    ledger, adm = Ledger(rclient, RUN), admission(rclient)
    jobs = [spec(i) for i in range(3)]
    ledger.call(t.enqueue(ledger.k, "P", jobs, 100))
    seconds, micros = rclient.time()
    now_ms = seconds * 1000 + micros // 1000
    rclient.hset(
        keys.admission_used(SERVER),
        mapping={"window": 10, "window_ms": now_ms, "life_ms": 10_000, "life_dev": 0, "bound": 1},
    )

    def start(job_id: str) -> Claim | Full | str:
        req = adm.request(SERVER, 10_000, 100, "short")
        assert req is not None
        return ledger.call(t.start(ledger.k, job_id, "w1", 30, req))

    # When three start one after the other
    first, second, third = (start(job.job_id) for job in jobs)

    # Then two are claimed, and the third is not, told that the next group (both its starts) is
    # due in two seconds
    assert isinstance(first, Claim) and isinstance(second, Claim)
    assert isinstance(third, Full) and 1.9 < third.paced_s <= 2.0, third
    assert ledger.job(jobs[2].job_id)["state"] == "queued" and used(rclient)["paced"] == "1"


def test_start_tells_admission_how_many_of_the_run_are_left_so_its_tail_starts_at_once(
    rclient: redis.Redis,
) -> None:
    # Given a full paced window of ten requests spread over their lifetimes, on a pool where 12
    # more would fit if they started together now (tests/test_admission.py's case)
    ledger, adm = Ledger(rclient, RUN), admission(rclient)
    spread_in_flight(rclient)

    def start(run: Ledger, job_id: str) -> Claim | Full | str:
        req = adm.request(SERVER, 4000, 300, "short")
        assert req is not None
        return run.call(t.start(run.k, job_id, "w1", 30, req))

    # When a run has 13 jobs queued: then its first is not claimed
    jobs = [spec(i) for i in range(13)]
    ledger.call(t.enqueue(ledger.k, "P", jobs, 100))
    assert isinstance(start(ledger, jobs[0].job_id), Full)
    # When another has 12: then all twelve start, one after the other
    other = Ledger(rclient, "sf2")
    other.call(t.enqueue(other.k, "P", jobs[:12], 100))
    assert all(isinstance(start(other, job.job_id), Claim) for job in jobs[:12])
    assert used(rclient)["tail"] == "12"


def test_start_on_a_job_that_cannot_be_claimed_admits_nothing(rclient: redis.Redis) -> None:
    ledger, adm = Ledger(rclient, RUN), admission(rclient)
    done, busy, cancelled = spec(1), spec(2), spec(3)
    ledger.call(t.enqueue(ledger.k, "P", [done, busy, cancelled], 100))
    c = ledger.call(t.claim(ledger.k, done.job_id, "w0", 30))
    assert (
        isinstance(c, Claim) and ledger.call(t.commit(ledger.k, c, {"content": "x", "usage": {}}, 0)) == "ok"
    )
    assert isinstance(ledger.call(t.claim(ledger.k, busy.job_id, "w0", 30)), Claim)
    assert isinstance(ledger.call(t.claim(ledger.k, cancelled.job_id, "w0", 30)), Claim)
    # its worker died (the lease is past) after `cancel` marked it: the reaper ends it cancelled
    rclient.hset(keys.RunKeys(RUN).job(cancelled.job_id), mapping={"cancel": "1", "lease": "0"})

    for job, reason in ((done, "done"), (busy, "busy"), (cancelled, "cancelled")):
        req = adm.request(SERVER, 1000, 10, "short")
        assert req is not None
        assert ledger.call(t.start(ledger.k, job.job_id, "w1", 30, req)) == reason
    req = adm.request(SERVER, 1000, 10, "short")
    assert req is not None and ledger.call(t.start(ledger.k, "P:nope", "w1", 30, req)) == "missing"

    assert slots(rclient) == [] and used(rclient).get("n", "0") == "0"


def test_finish_commits_and_releases_the_slot_whatever_the_verdict(rclient: redis.Redis) -> None:
    ledger, adm = Ledger(rclient, RUN), admission(rclient)
    a, b = spec(1), spec(2)
    ledger.call(t.enqueue(ledger.k, "P", [a, b], 100))
    claims = []
    for job in (a, b):
        req = adm.request(SERVER, 1000, 300, "short")
        assert req is not None
        claim = ledger.call(t.start(ledger.k, job.job_id, "w1", 30, req))
        assert isinstance(claim, Claim)
        claims.append(claim)
    assert used(rclient)["n"] == "2"
    # (the first continued a checkpoint of 6 tokens: its attempt generated 10 - 6)
    first = {"content": "hi", "usage": {"completion_tokens": 10, "prompt_tokens": 5}, "continued_tokens": 6}
    result = {"content": "hi", "usage": {"completion_tokens": 2, "prompt_tokens": 5}}

    assert ledger.call(t.commit(ledger.k, claims[0], first, 4)) == "ok"
    assert ledger.job(a.job_id)["state"] == "done"
    assert slots(rclient) == [claims[1].slot[2]]  # type: ignore[index]
    assert (used(rclient)["n"], used(rclient)["total"]) == ("1", "300")
    # and the tokens its attempt generated are the first output length measured (admission paces
    # outputs of about one length)
    # (its deviation unknown from one output: as large as it)
    assert (used(rclient)["len_mean"], used(rclient)["len_dev"]) == ("4", "4")

    # a stale claim (another worker took the job over) commits nothing, but its slot is freed
    ledger.call(t.release(ledger.k, claims[1], JobError("x", "y"), delay_s=0, burn=False, max_attempts=8))
    assert ledger.call(t.commit(ledger.k, claims[1], result, 2)) == "stale"
    assert ledger.job(b.job_id)["state"] == "queued"
    assert slots(rclient) == [] and (used(rclient)["n"], used(rclient)["total"]) == ("0", "0")
    assert (float(used(rclient)["len_mean"]), float(used(rclient)["len_dev"])) == (3.0, 2.0)
    assert counts(ledger) == {"queued": 1, "running": 0, "done": 1, "failed": 0}
