"""Credentials in URLs reach no output: not an error, a start line, a key name, a result, a log."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import redis

from tests.pipeline import cli, wait_run_finished, write_jsonl
from tests.procs import Proc, RedisServer, spawn, start_sim, start_worker, wait_for, worker_env
from tokenmill.local_redis import free_port

WRONG, RIGHT, SERVER_SECRET = "Wr0ng-pw-71", "R1ght-pw-42", "Srv-s3cret-9"


def test_a_redis_password_in_the_url_or_its_options_is_shown_in_no_error_start_line_or_worker_log(
    tmp_path: Path, procs: list[Proc]
) -> None:
    # Given a Redis that needs a password, and sentinels that are not there
    guarded = RedisServer(tmp_path / "guarded", password=RIGHT)
    guarded.start()
    try:
        _shown_nowhere(tmp_path, procs, f"127.0.0.1:{guarded.port}")
    finally:
        guarded.kill()


def _shown_nowhere(tmp_path: Path, procs: list[Proc], at: str) -> None:
    nowhere = f"sentinel://:{WRONG}@127.0.0.1:{free_port()};sentinel://:{WRONG}@127.0.0.1:{free_port()}"
    wrong = [f"redis://:{WRONG}@{at}/0", f"redis://{at}/0?password={WRONG}", f"{nowhere}/0?master_name=m"]
    # When the commands that read Redis are given a wrong password, or sentinels that are gone
    for url in wrong:
        for args in (("runs",), ("status", "--run", "r", "--json")):
            res = cli(*args, env={"TOKENMILL_REDIS_URL": url}, check=False)
            # Then they fail, naming where, and the password appears nowhere
            assert res.returncode != 0, res
            assert WRONG not in res.stdout + res.stderr, res.stderr
            assert "127.0.0.1" in res.stderr, res.stderr
    # When a worker, the dashboard and the metrics exporter start with the right one (in the URL,
    # or as redis-py's option)
    for url in (f"redis://:{RIGHT}@{at}/0", f"redis://{at}/0?password={RIGHT}"):
        env = {"TOKENMILL_REDIS_URL": url}
        worker = start_worker(tmp_path, "short", worker_env(url, "http://127.0.0.1:9"), concurrency=1)
        procs.append(worker)
        # Then the worker is up (Celery's broker took the option too) and logs no password
        assert RIGHT not in worker.output() and f"Connected to redis://:**@{at}/0" in worker.output()
        worker.stop()
        for cmd in ("dashboard", "metrics"):
            port = str(free_port())
            proc = spawn(
                [sys.executable, "-m", "tokenmill.cli", cmd, "--port", port],
                tmp_path / f"{cmd}-{port}.log",
                env=env,
            )
            procs.append(proc)
            wait_for(
                lambda p=proc, port=port: f":{port}" in p.output() or not p.alive(), 30, f"{cmd}'s start line"
            )
            # Then their start line names Redis without the password
            assert proc.alive() and f"tokenmill {cmd} on http://" in proc.output(), proc.output()
            assert RIGHT not in proc.output() and f"{at}/0" in proc.output(), proc.output()


def test_a_server_reached_with_user_and_password_keeps_them_out_of_keys_results_status_and_logs(
    tmp_path: Path, redis_url: str, rclient: redis.Redis, procs: list[Proc]
) -> None:
    # Given a server reached as http://user:secret@host:port (the sim takes any credentials)
    sim, url = start_sim(tmp_path)
    procs.append(sim)
    server = url.replace("http://", f"http://tm-user:{SERVER_SECRET}@")
    env = worker_env(redis_url, server)
    rows = [{"id": str(i), "prompt": f"question {i}"} for i in range(6)]
    cli("enqueue", str(write_jsonl(tmp_path / "P.jsonl", rows)), "--run", "r", env=env)
    # When a worker runs the jobs there
    worker = start_worker(tmp_path, "short", env, concurrency=4)
    procs.append(worker)
    doc = wait_run_finished(rclient, "r", 60)
    assert doc["totals"]["done"] == 6, doc["failure_messages"]
    status = cli("status", "--run", "r", "--json", env=env).stdout
    worker.stop()
    # Then the secret is in no key name, no result's server, no status, no worker log line
    names = [k.decode() for k in rclient.scan_iter("*")]
    assert not [n for n in names if SERVER_SECRET in n or "tm-user" in n]
    assert any(url.removeprefix("http://") in n for n in names), names  # the server's admission keys
    shown = url.replace("http://", "http://***@")
    assert {orjson.loads(rclient.hget(f"tm:r:job:P:{i}", "result"))["server"] for i in range(6)} == {shown}
    assert SERVER_SECRET not in status and shown in orjson.loads(status)["admission"]
    assert SERVER_SECRET not in worker.output()
    # and the credentials still reached the server: its capacity was read with them
    assert "/server_info failed" not in worker.output(), worker.output()
