"""The pipeline through the real sglang-router (0.3.2) in front of real SGLang 0.5.23 servers.

``TOKENMILL_SERVER_URL`` names the router alone, as a user who put it in front of their servers
would. A server behind it is SIGKILLed mid-run, then the router itself, and restarted: every
prompt ends done exactly once and every result equals its request regenerated alone. The router
forwards a stream's usage only on its last chunk (0.3.2: seen), so a checkpoint taken through it
counts chunks, not the server's tokens: a stream cut there starts over, and says so
(``workers.attempt.uncounted``). Admission steers a window through the router (the
router has no ``/v1/loads``: its ``/engine_metrics`` carries every worker's figures), and reasoning
streamed in multi-token chunks passes through it unchanged.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from tests.chaos import all_job_ids, mid_stream, results, running_jobs, wait_finished
from tests.continued import assert_exact_after_cuts
from tests.engines import API_KEY, MAX_TOTAL_TOKENS, PLAIN_FLAGS, EnginePool, start_engine
from tests.pipeline import cli, read_export, write_jsonl
from tests.procs import Proc, start_worker, wait_for, worker_env
from tests.router import start_router
from tests.sglang_client import chat
from tokenmill import keys, server_report

pytestmark = pytest.mark.sglang
SHARED_REAL_ENGINES = ("plain", "deepseek")  # what tests/conftest.py starts with the session
WORDS = ["alpha", "beta", "gamma", "δέλτα", "日本語", "emoji🙂", "naïve", "zeta"]
MAX_TOKENS = 400  # long enough that streams are cut mid-way (as in test_sglang_pipeline.py)
JOBS = 16


def running_on(url: str) -> int:
    """Requests running on a server, by its own ``/v1/loads`` (0 once it is gone)."""
    try:
        return server_report.loads(url, API_KEY, 5.0).running
    except (OSError, ValueError):
        return 0


def test_through_the_router_a_server_killed_behind_it_then_the_router_killed_lose_nothing(
    engine_pool: EnginePool, tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given the router (cache-aware, with an API key) in front of two SGLang servers, the
    # session's shared one and one of this test's own, and a worker whose only server is the
    # router, streaming 16 greedy prompts
    shared = engine_pool.shared("sglang", "plain")
    own = start_engine("sglang", tmp_path, *PLAIN_FLAGS, api_key=API_KEY)
    router = start_router(tmp_path, [shared.url, own.url], api_key=API_KEY)
    try:
        rows = [
            {"prompt": f"routed {i}: " + " ".join(WORDS[(i + j) % 8] for j in range(i % 5 + 2))}
            for i in range(JOBS)
        ]
        env = worker_env(redis_url, router.url, api_key=API_KEY)
        cli("enqueue", str(write_jsonl(tmp_path / "R.jsonl", rows)), "--run", "routed", "--temperature", "0",
            "--short-max-tokens", str(MAX_TOKENS), env=env)  # fmt: skip
        procs.append(start_worker(tmp_path, "short", env, concurrency=8))

        # admission reads the workers' figures through the router and steers a window there (it
        # starts one once a request is in flight; admission decides by it at the next ask, which
        # may wait until a 400-token stream ends)
        used = keys.admission_used(router.url)
        wait_for(
            lambda: int(rclient.hget(used, "window") or 0) >= 2, 60, "admission's window through the router"
        )
        assert server_report.loads(router.url, API_KEY, 10).capacity == 2 * MAX_TOTAL_TOKENS

        # When the server of its own is SIGKILLed while it streams some of the jobs
        wait_for(lambda: running_on(own.url) >= 2 and len(mid_stream(rclient, "routed")) >= 3, 120,
                 "streams with checkpoints on the server behind the router", 0.05)  # fmt: skip
        os.killpg(own.proc.pgid, signal.SIGKILL)
        # and once the run goes on through the router, the router itself is SIGKILLed with
        # streams open through it, and started again on its port
        done_at_kill = int(rclient.hget(keys.RunKeys("routed").counts(), "done|R") or 0)
        wait_for(lambda: int(rclient.hget(keys.RunKeys("routed").counts(), "done|R") or 0) > done_at_kill
                 and sum(v.ckpt_tokens > 0 for v in running_jobs(rclient, "routed").values()) >= 2, 180,
                 "more jobs done through the router and two streaming with a checkpoint", 0.05)  # fmt: skip
        router.kill()
        wait_for(
            lambda: not running_jobs(rclient, "routed"), 60, "the streams cut with the router to be released"
        )
        router.stop()
        router = start_router(
            tmp_path, [shared.url, own.url], api_key=API_KEY, port=router.port, wait_workers=[shared.url]
        )
        wait_finished(rclient, "routed", JOBS, 300)

        # Then every prompt is done exactly once and none failed, and every result equals its
        # solo regeneration (the two servers share the model and the seed): no stream cut
        # through the router was continued from its chunk-counted checkpoint; those that held
        # one (the router's own cut left two at least) started over and say so
        continued = assert_exact_after_cuts(
            rclient, "routed", JOBS, shared, {}, MAX_TOKENS, env, tmp_path / "out"
        )
        assert continued == 0
        ids = all_job_ids(rclient, "routed")
        got = results(rclient, "routed", ids)
        restarted = [j for j, r in got.items() if r.get("restarted")]
        assert len(restarted) >= 2, restarted
        assert all(got[j]["discarded_tokens"] > 0 and got[j]["continued_tokens"] == 0 for j in restarted)
        retries = [int(rclient.hget(keys.RunKeys("routed").job(j), "retries") or 0) for j in ids]
        # (each kill cuts a job once; a job can also meet the router's error for a request it
        # sent to the killed server before its health checks dropped it: 3 was seen once)
        assert max(retries) <= 3, retries
        print(f"through the router: {len(restarted)} restarted, {sum(retries)} retries spent")
    finally:
        router.stop()
        own.stop()


def test_reasoning_in_multi_token_chunks_passes_through_the_router_unchanged(
    engine_pool: EnginePool, tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given the router in front of the session's SGLang server with a reasoning parser and
    # four tokens a chunk
    engine = engine_pool.shared("sglang", "deepseek")
    router = start_router(tmp_path, [engine.url])
    try:
        # When six prompts run through it
        rows = [
            {"id": str(i), "prompt": f"Think about caches {i}, then answer. δέλτα 日本語"} for i in range(6)
        ]
        env = worker_env(redis_url, router.url)
        cli("enqueue", str(write_jsonl(tmp_path / "T.jsonl", rows)), "--run", "think", "--temperature", "0",
            "--short-max-tokens", "40", env=env)  # fmt: skip
        procs.append(start_worker(tmp_path, "short", env, concurrency=3))
        wait_finished(rclient, "think", 6, 120)

        # Then each exported row holds the reasoning and answer the server gives the request alone
        cli("export", "--run", "think", "--out", str(tmp_path / "out"), "--include-truncated", env=env)
        exported = read_export(tmp_path / "out")["T"]
        assert len(exported) == 6
        for row in exported:
            alone = chat(engine, row["messages"][:-1], max_tokens=40, temperature=0)["choices"][0]["message"]
            answer = row["messages"][-1]
            assert alone["reasoning_content"], "the tiny model's output is reasoning (deepseek-r1 parser)"
            assert answer.get("reasoning_content") == alone["reasoning_content"], row["id"]
            assert (answer["content"] or "") == (alone["content"] or ""), row["id"]
    finally:
        router.stop()
