"""Prefix affinity across several servers: a job's prefix key, the rendezvous order of the ready
servers, and the dispatch it gives on real workers and two sims (samples of a prompt stay on
the server their prompt prefers while it has room, and spill to the other when it is full)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import orjson
import redis

from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import ROOT, Proc, start_sim, start_worker, worker_env
from tokenmill import keys
from tokenmill.settings import Settings
from workers.admission import affinity

SERVERS = ["http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"]


def user(text: str, *before: dict[str, object]) -> dict[str, object]:
    return {"model": "m", "messages": [*before, {"role": "user", "content": text}], "max_tokens": 100}


def prefix_key(request: dict[str, object], long_system: bool = True) -> bytes:
    return affinity.prefix(request, long_system).key


def key_of(prompt: str) -> bytes:
    """The key of a ``prompt`` row's jobs (``enqueue`` sends it as one user message)."""
    return prefix_key({"messages": [{"role": "user", "content": prompt}]})


def preferred(key: bytes, servers: list[str]) -> str:
    return servers[affinity.ranked(key, servers)[0]]


# --- the key ---------------------------------------------------------------------------------


def test_samples_of_a_prompt_share_a_key_and_distinct_prompts_do_not() -> None:
    a = user("what is a radix tree?")
    assert prefix_key({**a, "seed": 1}) == prefix_key({**a, "seed": 2, "temperature": 1})
    assert prefix_key(a) != prefix_key(user("what is a trie?"))


def test_turns_of_a_conversation_share_a_key() -> None:
    system = {"role": "system", "content": "You are terse."}
    first = user("hello", system)
    reply = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "and?"}]
    later = {**first, "messages": [*first["messages"], *reply]}
    assert prefix_key(first) == prefix_key(later)


def test_rows_sharing_a_long_system_message_share_its_key_and_short_ones_spread() -> None:
    # a long system message (an instruction or few-shot block) is the key: its rows share a server
    long = {"role": "system", "content": "A long instruction block. " * 80}  # 2,080 characters
    assert len({prefix_key(user(f"question {i}", long)) for i in range(50)}) == 1
    # a short one is not worth a server: its rows spread by their first user message
    short = {"role": "system", "content": "A short instruction. " * 90}  # 1,890 characters
    keys_ = {prefix_key(user(f"question {i}", short)) for i in range(50)}
    assert len(keys_) == 50
    assert len({preferred(k, SERVERS[:2]) for k in keys_}) == 2
    # and without admission to spill them (long_system=False) long ones spread too
    assert len({prefix_key(user(f"q {i}", long), long_system=False) for i in range(50)}) == 50


def test_the_key_ignores_key_order_and_takes_content_parts_and_rendered_options() -> None:
    parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "x"}}]
    a = {"messages": [{"role": "user", "content": parts}]}
    b = {"messages": [{"content": [dict(reversed(p.items())) for p in parts], "role": "user"}]}
    assert prefix_key(a) == prefix_key(b)
    assert prefix_key(a) != key_of("describe")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert prefix_key({**a, "tools": [tool]}) != prefix_key(a)
    assert prefix_key({**a, "lora_path": "ad1"}) != prefix_key({**a, "lora_path": "ad2"})
    # no user message at all: every message is the key
    only = {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}
    assert prefix_key(only) != prefix_key({"messages": only["messages"][:1]})


def test_keys_and_ranks_are_the_same_in_every_process() -> None:
    # Given a key and its rank computed here, When another interpreter (another hash seed)
    # computes them, Then they are the same: no Python hash() anywhere
    req = user("stable?", {"role": "system", "content": "s"})
    code = (
        "import orjson, sys; from workers.admission import affinity; r = orjson.loads(sys.argv[1]); "
        "k = affinity.prefix(r).key; print(k.hex(), affinity.ranked(k, r['servers']))"
    )
    here = f"{prefix_key(req).hex()} {affinity.ranked(prefix_key(req), SERVERS)}"
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code, orjson.dumps({**req, "servers": SERVERS}).decode()],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert out.stdout.strip() == here


# --- the rendezvous order ------------------------------------------------------------------------


def test_distinct_keys_spread_evenly_over_the_servers() -> None:
    ks = [prefix_key(user(f"prompt {i}")) for i in range(3000)]
    for n in (2, 3):
        counts = Counter(preferred(k, SERVERS[:n]) for k in ks)
        assert len(counts) == n
        for c in counts.values():  # within 10% of an even share (3 standard deviations is ~5%)
            assert abs(c - 3000 / n) < 0.1 * 3000 / n, counts


def test_a_server_joining_or_leaving_moves_only_its_share_of_keys() -> None:
    ks = [prefix_key(user(f"prompt {i}")) for i in range(3000)]
    before = {k: preferred(k, SERVERS[:2]) for k in ks}
    after = {k: preferred(k, SERVERS) for k in ks}
    moved = [k for k in ks if before[k] != after[k]]
    assert all(after[k] == SERVERS[2] for k in moved)  # only to the new server
    assert abs(len(moved) - 1000) < 100  # ~1/3 of the keys
    gone = {k: preferred(k, [SERVERS[0], SERVERS[2]]) for k in ks}  # the second server leaves
    assert all(gone[k] == after[k] for k in ks if after[k] != SERVERS[1])


def test_the_preferred_server_comes_first_then_the_least_full() -> None:
    key = prefix_key(user("x"))
    rank = affinity.ranked(key, SERVERS)
    fullness = [0.0, 0.0, 0.0]
    fullness[rank[0]] = 0.55  # the preferred server is the fullest, within the slack: tried first
    fullness[rank[1]] = 0.5
    fullness[rank[2]] = 0.5 - affinity.BALANCE_SLACK / 2
    assert affinity.dispatch_order(key, SERVERS, fullness) == [rank[0], rank[2], rank[1]]
    fullness[rank[0]] = 0.5 - affinity.BALANCE_SLACK / 2 + affinity.BALANCE_SLACK * 1.01  # beyond it
    assert affinity.dispatch_order(key, SERVERS, fullness) == [rank[2], rank[1], rank[0]]
    # a sibling's home comes first however full (its prefix is cached there), then only the
    # servers emptier than it by more than the slack: about as busy, it waits for its home
    home = SERVERS[rank[1]]
    assert affinity.dispatch_order(key, SERVERS, [0.5, 0.5, 0.5], home) == [rank[1]]
    emptier = [0.5, 0.5, 0.5]
    emptier[rank[2]] = 0.5 - affinity.BALANCE_SLACK * 1.01
    assert affinity.dispatch_order(key, SERVERS, emptier, home) == [rank[1], rank[2]]
    # a server where a sibling is on its way to its first token is left out, the home too
    assert rank[0] not in affinity.dispatch_order(key, SERVERS, [0.0] * 3, cold=[SERVERS[rank[0]]])
    assert affinity.dispatch_order(key, SERVERS, emptier, home, cold=[home]) == [rank[2]]
    assert affinity.dispatch_order(key, SERVERS, [0.0] * 3, cold=SERVERS) == []
    # nothing admitted anywhere (admission not limiting): the rendezvous order, not the list's
    assert affinity.dispatch_order(key, SERVERS, [0.0, 0.0, 0.0]) == rank
    # affinity off: least full first, ties in a random order (the list's order sent every job to
    # the first server while admission, off, saw every server empty)
    assert affinity.dispatch_order(None, SERVERS, [0.4, 0.1, 0.4])[0] == 1
    firsts = Counter(affinity.dispatch_order(None, SERVERS, [0.0, 0.0, 0.0])[0] for _ in range(600))
    assert all(firsts[i] > 100 for i in range(3)), firsts


def test_a_siblings_home_comes_first_and_is_waited_for_within_the_wait() -> None:
    key, other = prefix_key(user("x")), prefix_key(user("y"))
    rank = affinity.ranked(key, SERVERS)
    home = SERVERS[rank[2]]  # a sibling spilled to the last server in the key's order
    assert affinity.dispatch_order(key, SERVERS, [0.0, 0.0, 0.0], home)[0] == rank[2]
    homes = affinity.Homes(ttl_s=60)
    job = affinity.JobAffinity(key, homes, wait_s=2.0)
    assert job.home(now=100.0) == (None, False)  # no sibling seen: the rendezvous order
    affinity.JobAffinity(key, homes, wait_s=2.0).admitted(home, now=100.5)
    assert job.home(now=101.0) == (home, True)  # the wait starts now...
    assert job.home(now=102.9) == (home, True)
    assert job.home(now=103.0) == (home, False)  # ...and ends 2 s later: spill
    assert affinity.JobAffinity(other, homes, 2.0).home(now=101.0) == (None, False)
    assert affinity.JobAffinity(key, homes, 2.0).home(now=160.5) == (None, False)  # forgotten after ttl_s
    no_wait = affinity.JobAffinity(key, homes, wait_s=0.0)  # the default: the home first, no wait
    assert no_wait.home(now=101.0) == (home, False)


def test_the_first_job_of_a_key_leads_and_its_siblings_wait_for_its_first_token() -> None:
    async def run() -> None:
        homes, prefills = affinity.Homes(ttl_s=60), affinity.Prefills()
        key, other = prefix_key(user("x")), prefix_key(user("y"))

        def job(k: bytes) -> affinity.JobAffinity:
            return affinity.JobAffinity(k, homes, 0.0, prefills)

        # Given a key's first job, which leads (nothing to wait for), and a sibling after it
        leader = job(key)
        assert leader.sibling_prefill(now=1.0) is None
        sibling = job(key).sibling_prefill(now=1.1)
        assert sibling is not None and not sibling.is_set()
        assert job(other).sibling_prefill(now=1.1) is None  # another key: its own leader
        # When the leader is admitted on s2 and its first token comes
        leader.admitted("s2", now=1.2)
        assert job(key).sibling_prefill(now=1.3) is sibling  # still waiting until the token
        assert leader.cold() == ["s2"]  # and no sibling goes to s2 before it (one prefill batch)
        leader.first_token()
        # Then the siblings go, to its server, and later ones neither wait nor lead
        assert sibling.is_set() and leader.cold() == []
        later = job(key)
        assert later.sibling_prefill(now=2.0) is None and later.home(now=2.0) == ("s2", False)
        assert prefills.get(key) is None
        leader.ended()  # the job's end: nothing left to do
        # a sibling admitted where the prefix is warm is not cold there; one spilled elsewhere is
        later.admitted("s2", now=2.1)
        assert later.cold() == []
        spilled = job(key)
        spilled.admitted("s1", now=2.2)
        assert spilled.cold() == ["s1"] and later.home(now=2.3) == ("s1", False)
        spilled.ended()  # ended without a token: s1 is neither cold nor warm for the key
        assert spilled.cold() == [] and homes.put(key, "s1", now=2.4)  # so the next one is cold

        # Given a leader that ends without a token and was never admitted (no home)
        z = prefix_key(user("z"))
        lost = job(z)
        assert lost.sibling_prefill(now=3.0) is None
        waiting = job(z).sibling_prefill(now=3.1)
        assert waiting is not None
        # When it ends
        lost.ended()
        # Then its siblings go, and the key's next job leads afresh
        assert waiting.is_set() and prefills.get(z) is None
        assert job(z).sibling_prefill(now=3.2) is None and prefills.get(z) is not None

    asyncio.run(run())


def test_homes_keep_the_most_recent_keys() -> None:
    homes = affinity.Homes(ttl_s=60, max_keys=2)
    a, b, c = (prefix_key(user(x)) for x in "abc")
    homes.put(a, "s1", 1.0)
    homes.put(b, "s2", 2.0)
    homes.put(a, "s1", 3.0)  # a used again: b is now the oldest
    homes.put(c, "s3", 4.0)
    assert (homes.get(a, 5.0), homes.get(b, 5.0), homes.get(c, 5.0)) == ("s1", None, "s3")


def test_the_settings_default_to_affinity_on_and_no_wait() -> None:
    assert Settings.load(env={}).server_affinity is True
    assert Settings.load(env={"TOKENMILL_SERVER_AFFINITY": "0"}).server_affinity is False
    assert Settings.load(env={}).server_affinity_wait_s == 0.0
    assert Settings.load(env={"TOKENMILL_SERVER_AFFINITY_WAIT_S": "1.5"}).server_affinity_wait_s == 1.5


# --- dispatch on real workers and two sims --------------------------------------------------------

SAMPLES = 6
SIM = ("--sim-step-ms", "15", "--sim-mean-output-tokens", "40")


def prompts_preferring(servers: list[str], each: dict[str, int]) -> list[str]:
    """Prompts (as ``enqueue`` sends a ``prompt`` row: one user message) whose preferred server
    is each of ``servers``, ``each[server]`` of them."""
    want = dict(each)
    out: list[str] = []
    i = 0
    while any(want.values()):
        text = f"prompt number {i}"
        server = preferred(key_of(text), servers)
        if want.get(server):
            want[server] -= 1
            out.append(text)
        i += 1
    return out


def run_samples(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], prompts: list[str], procs: list[Proc]
) -> dict[str, list[str]]:
    """Enqueue ``prompts`` with ``--samples``, run them on one worker, and return the servers
    each prompt's samples ran on (from each result's ``server``)."""
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(prompts)]
    src = write_jsonl(tmp_path / "P.jsonl", rows)
    cli("enqueue", str(src), "--run", "r", "--samples", str(SAMPLES), "--short-max-tokens", "100", env=env)
    procs.append(start_worker(tmp_path, "short", env, concurrency=8))
    doc = wait_run_finished(rclient, "r", 120)
    assert doc["totals"]["done"] == len(prompts) * SAMPLES
    k = keys.RunKeys("r")
    ran: dict[str, list[str]] = defaultdict(list)
    for i, p in enumerate(prompts):
        for s in range(SAMPLES):
            job = k.job(f"P:{i}#{s}")
            spec = orjson.loads(rclient.hget(job, "spec"))
            assert prefix_key(spec["request"]) == key_of(p)  # as the test reckoned
            ran[p].append(orjson.loads(rclient.hget(job, "result"))["server"])
    return ran


def affinity_env(redis_url: str, urls: list[str], **settings: object) -> dict[str, str]:
    # the token budget alone limits (no closed-loop window), so "has room" is the budget's say
    return worker_env(redis_url, ",".join(urls), admission_closed_loop=0, **settings)


def test_samples_of_a_prompt_run_on_the_server_it_prefers_while_it_has_room(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given two sims with room for every job, and prompts of which two prefer each
    sims = [start_sim(tmp_path, *SIM) for _ in range(2)]
    procs += [p for p, _ in sims]
    urls = [u for _, u in sims]
    prompts = prompts_preferring(urls, {urls[0]: 2, urls[1]: 2})
    # When their samples run
    ran = run_samples(tmp_path, rclient, affinity_env(redis_url, urls), prompts, procs)
    # Then every sample of a prompt ran on its preferred server, and both servers served
    for p in prompts:
        want = preferred(key_of(p), urls)
        assert set(ran[p]) == {want}, (p, Counter(ran[p]))
    assert {s for r in ran.values() for s in r} == set(urls)


def test_samples_spill_to_the_other_server_when_the_preferred_one_is_full(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a preferred server whose token budget holds three requests at once
    # (0.9 x 400 tokens, a request holding up to its prompt + 100), and a roomy other one
    small, url_small = start_sim(tmp_path, *SIM, "--max-total-tokens", "400")
    big, url_big = start_sim(tmp_path, *SIM)
    procs += [small, big]
    urls = [url_small, url_big]
    prompts = prompts_preferring(urls, {url_small: 2})
    # When their 12 samples run on 8 threads
    ran = run_samples(tmp_path, rclient, affinity_env(redis_url, urls), prompts, procs)
    # Then the preferred server was filled first (its budget's three at the start, refilled as
    # each ended: 5 to 8 of the 12 here; least full first, it runs about one, as the roomy
    # server is always the less full), and what it had no room for ran on the other
    counts = Counter(s for r in ran.values() for s in r)
    assert counts[url_small] >= 3 and counts[url_big] >= 1, counts
    assert sum(counts.values()) == len(prompts) * SAMPLES


def test_with_a_wait_the_samples_of_a_prompt_wait_for_the_server_the_first_went_to(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given the spill test's servers, and server_affinity_wait_s longer than a few requests last
    small, url_small = start_sim(tmp_path, *SIM, "--max-total-tokens", "400")
    big, url_big = start_sim(tmp_path, *SIM)
    procs += [small, big]
    urls = [url_small, url_big]
    prompts = prompts_preferring(urls, {url_small: 2})
    env = affinity_env(redis_url, urls, server_affinity_wait_s=5)
    # When their 12 samples run on 8 threads
    ran = run_samples(tmp_path, rclient, env, prompts, procs)
    # Then each prompt's samples ran on one server: the first sample's (the preferred one, or
    # the other if it spilled), the rest waiting for a slot there instead of spilling
    for p in prompts:
        assert len(set(ran[p])) == 1, (p, Counter(ran[p]))


def test_with_affinity_off_samples_go_least_full_first_as_before(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given the first test's setup with TOKENMILL_SERVER_AFFINITY=0
    sims = [start_sim(tmp_path, *SIM) for _ in range(2)]
    procs += [p for p, _ in sims]
    urls = [u for _, u in sims]
    prompts = prompts_preferring(urls, {urls[0]: 2, urls[1]: 2})
    env = affinity_env(redis_url, urls, server_affinity=0)
    # When their samples run
    ran = run_samples(tmp_path, rclient, env, prompts, procs)
    # Then jobs alternate by load: samples of one prompt run on both servers
    assert any(set(ran[p]) == set(urls) for p in prompts), ran


def test_the_samples_of_a_prompt_wait_for_the_first_ones_token_though_another_server_has_room(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given two sims whose prefill is slow and whose KV pool is small: the first sample in flight
    # makes its server fuller than the other by more than the slack, so a sample that asked for
    # a slot before the first one's token would leave that cold server out and go to the other
    flags = ("--sim-prefill-tokens-per-ms", "1", "--max-total-tokens", "3000")
    sims = [start_sim(tmp_path, *SIM, *flags) for _ in range(2)]
    procs += [p for p, _ in sims]
    urls = [u for _, u in sims]
    prompt = "one prompt: " + "a long shared prompt " * 50

    # When its samples run on 8 threads
    ran = run_samples(tmp_path, rclient, affinity_env(redis_url, urls), [prompt], procs)

    # Then none asked before the first one's token came (the leader rule, not the cold-server
    # rule): all ran on its server, where the prompt was cached
    assert len(set(ran[prompt])) == 1, Counter(ran[prompt])


def test_the_samples_of_a_prompt_wait_for_the_first_ones_first_token_then_go_to_its_server(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given two sims whose prefill is slow (a token a millisecond: these prompts take ~0.3 s)
    sims = [start_sim(tmp_path, *SIM, "--sim-prefill-tokens-per-ms", "1") for _ in range(2)]
    procs += [p for p, _ in sims]
    urls = [u for _, u in sims]
    prompts = [f"prompt number {i}: " + "a long shared prompt " * 50 for i in range(2)]
    # When their samples run on 8 threads
    ran = run_samples(tmp_path, rclient, affinity_env(redis_url, urls), prompts, procs)
    # Then each prompt's first sample ran alone until its first token, and the others were
    # claimed after it (its prompt then cached), on its server
    k = keys.RunKeys("r")
    for i, p in enumerate(prompts):
        claims = []
        for s in range(SAMPLES):
            job = rclient.hmget(k.job(f"P:{i}#{s}"), ["claimed_ms", "result"])
            claims.append((int(job[0]), orjson.loads(job[1])["ttft_s"]))
        claims.sort()
        (lead_ms, lead_ttft), rest = claims[0], claims[1:]
        assert lead_ttft > 0.1, claims  # the slow prefill, so the test can tell
        first_token_ms = lead_ms + lead_ttft * 1000
        assert all(ms >= first_token_ms - 5 for ms, _ in rest), (first_token_ms, claims)
        assert len(set(ran[p])) == 1, (p, Counter(ran[p]))
