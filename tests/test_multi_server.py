"""Several servers: work spreads over them; losing one mid-run loses nothing."""

from __future__ import annotations

from pathlib import Path

import orjson
import redis

from tests.pipeline import cli, expected_for, read_export, wait_run_finished, write_jsonl
from tests.procs import Proc, sim_stats, start_sim, start_worker, wait_for, worker_env

MEAN = 60


def test_a_run_spreads_over_two_servers_and_survives_losing_one(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given two sims behind one comma-separated TOKENMILL_SERVER_URL and two worker processes
    knobs = ("--sim-mean-output-tokens", str(MEAN), "--sim-step-ms", "15")
    sim_a, url_a = start_sim(tmp_path, *knobs)
    sim_b, url_b = start_sim(tmp_path, *knobs)
    procs += [sim_a, sim_b]
    env = worker_env(redis_url, f"{url_a},{url_b}")
    rows = [{"id": str(i), "prompt": f"question number {i}"} for i in range(80)]
    cli(
        "enqueue",
        str(write_jsonl(tmp_path / "P.jsonl", rows)),
        "--run",
        "r",
        "--short-max-tokens",
        "200",
        env=env,
    )
    procs.append(start_worker(tmp_path, "short", env, concurrency=12))
    procs.append(start_worker(tmp_path, "short", env, concurrency=12))

    # When server A is killed after it finished jobs, while streams on it are past a checkpoint
    def served_by_a() -> bool:
        return any(
            (raw := rclient.hget(k, "result")) and orjson.loads(raw)["server"] == url_a
            for k in rclient.scan_iter("tm:r:job:*")
        )

    def streams_past_a_checkpoint_on_a() -> bool:  # the workers checkpoint every 8 tokens
        return any(g >= 16 for g in sim_stats(url_a)["running_generated"])

    wait_for(lambda: served_by_a() and streams_past_a_checkpoint_on_a(), 60, "A served jobs, streams mid-way")
    done_before = int(rclient.hget("tm:r:counts", "done|P") or 0)
    sim_a.kill()

    # Then the run finishes on B: every job exactly once, none failed, texts exact
    doc = wait_run_finished(rclient, "r", 120)
    assert doc["totals"]["done"] == 80 and doc["totals"]["failed"] == 0
    results = [orjson.loads(rclient.hget(f"tm:r:job:P:{i}", "result")) for i in range(80)]
    servers = {r["server"] for r in results}
    assert servers == {url_a, url_b}, (
        f"both servers should have served jobs (done before kill: {done_before})"
    )
    out = tmp_path / "out"
    cli("export", "--run", "r", "--out", str(out), "--include-truncated", env=env)
    exported = read_export(out)["P"]
    assert sorted(int(r["id"]) for r in exported) == list(range(80))
    for row in exported:
        want = expected_for(row, max_tokens=200, reasoning=False, mean_output_tokens=MEAN)
        assert row["messages"][-1]["content"] == want.content
    # the streams cut on A continued on B from their checkpoints, without burning a retry
    assert any(r["continued_tokens"] > 0 and r["server"] == url_b for r in results)
    assert all(int(rclient.hget(f"tm:r:job:P:{i}", "retries") or 0) == 0 for i in range(80))
