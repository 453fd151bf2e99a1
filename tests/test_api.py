"""``tokenmill api``: OpenAI's Batch API served by tokenmill, driven by the real ``openai`` SDK
against a live stack (redis-server, celery workers, the sim), faults injected with real signals.

Shapes are checked with the SDK's own types (``Batch``, ``FileObject``) and its own parsing."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import redis
from openai import OpenAI
from openai.types import Batch, FileObject

from producer.api.batches import Batches
from server_mgr.sim.textgen import expected_completion
from tests.pipeline import cli
from tests.procs import Proc, RedisServer, http_status, spawn, start_sim, start_worker, wait_for, worker_env
from tokenmill import Client, keys
from tokenmill.local_redis import free_port

KEYS = ("k-first", "k-second")
MEAN = 40  # the sim's mean output tokens
MAX_TOKENS = 60
CONTEXT = 1024  # the sim's context length: a longer prompt is refused (400)
SIM_FLAGS = ("--context-length", str(CONTEXT), "--sim-mean-output-tokens", str(MEAN), "--sim-step-ms", "8")


# README's "Drop-in for OpenAI's Batch API": the code that runs a batch against `tokenmill api`
DROP_IN = """\
import time
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8090/v1", api_key="k1")  # one of TOKENMILL_API_KEYS
f = client.files.create(file=open("batch_input.jsonl", "rb"), purpose="batch")
batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    time.sleep(10)
    batch = client.batches.retrieve(batch.id)
print(batch.status, batch.request_counts)
print(client.files.content(batch.output_file_id).text)
"""


@dataclass
class Stack:
    workdir: Path
    redis: redis.Redis
    env: dict[str, str]
    sim: Proc
    sim_port: int
    port: int
    procs: list[Proc] = field(default_factory=list)
    api: Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, key: str = KEYS[1]) -> OpenAI:
        return OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=30)

    def start_api(self, port: int | None = None, env: dict[str, str] | None = None) -> Proc:
        """A ``tokenmill api`` process, listening."""
        port = port or self.port
        args = [sys.executable, "-m", "tokenmill.cli", "api", "--port", str(port)]
        proc = spawn(args, self.workdir / f"api-{port}.log", env={**self.env, **(env or {})})
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}/v1/files"
        wait_for(lambda: http_status(url) == 401 or not proc.alive(), 30, "tokenmill api listening")
        assert proc.alive(), proc.output()
        return proc

    def restart_sim(self) -> None:
        """SIGKILL the sim and start another at its port."""
        self.sim.proc.send_signal(signal.SIGKILL)
        self.sim.proc.wait(10)
        self.sim, _ = start_sim(self.workdir, *SIM_FLAGS, port=self.sim_port)
        self.procs.append(self.sim)


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One sim, one worker and one API process for the module (each test's batch is its own run)."""
    workdir = tmp_path_factory.mktemp("api")
    if not redis_server.ping():
        redis_server.start()
    redis_server.client().flushall()
    sim, sim_url = start_sim(workdir, *SIM_FLAGS)
    env = worker_env(redis_server.url, sim_url)
    env.update(
        {
            "TOKENMILL_API_KEYS": ",".join(KEYS),
            "TOKENMILL_RESULTS_URL": str(workdir / "store"),
            "TOKENMILL_API_POLL_S": "0.2",
            "TOKENMILL_API_MAX_FILE_BYTES": str(4 << 20),
        }
    )
    s = Stack(workdir, redis_server.client(), env, sim, int(sim_url.rsplit(":", 1)[1]), free_port())
    s.procs += [sim, start_worker(workdir, "short", env, concurrency=4)]
    s.api = s.start_api()
    try:
        yield s
    finally:
        for p in reversed(s.procs):
            p.kill()


# -- input files and what the sim answers ---------------------------------------------------------


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"batch question {i}: say something"}]


def line(i: int, **body: Any) -> dict[str, Any]:
    full = {"model": "gpt-4o-mini", "messages": messages(i), "max_tokens": MAX_TOKENS, **body}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": full}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else orjson.dumps(x)) + b"\n" for x in lines)


def expected(i: int) -> str:
    return expected_completion(messages(i), max_tokens=MAX_TOKENS, mean_output_tokens=MEAN).content


def upload(client: OpenAI, lines: list[Any], name: str = "input.jsonl") -> FileObject:
    return client.files.create(file=(name, jsonl(lines)), purpose="batch")


def run_batch(client: OpenAI, lines: list[Any], window: str = "24h") -> Batch:
    f = upload(client, lines)
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window
    )


def wait_status(client: OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 90) -> Batch:
    def reached() -> Batch | None:
        b = client.batches.retrieve(batch_id)
        return b if b.status in statuses else None

    return wait_for(reached, timeout, f"batch {batch_id} to be {' or '.join(statuses)}")


def wait_some_done(client: OpenAI, batch_id: str, n: int = 5) -> Batch:
    def some() -> Batch | None:
        b = client.batches.retrieve(batch_id)
        assert b.status in ("validating", "in_progress"), b.status
        return b if b.request_counts and b.request_counts.completed >= n else None

    return wait_for(some, 60, f"{n} requests of {batch_id} done")


def content(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [orjson.loads(x) for x in client.files.content(file_id).read().splitlines()]


def check_outputs(out: list[dict[str, Any]], ids: range) -> None:
    """One line per custom_id, each the exact text the sim generates for its request."""
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in ids)
    for o in out:
        i = int(o["custom_id"].removeprefix("req-"))
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["message"]["content"] == expected(i), o["custom_id"]


def raw_batch(stack: Stack, batch_id: str) -> dict[str, Any]:
    req = urllib.request.Request(
        f"{stack.url}/batches/{batch_id}", headers={"Authorization": f"Bearer {KEYS[0]}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc: dict[str, Any] = orjson.loads(resp.read())
    return doc


# -- the tests ------------------------------------------------------------------------------------


def test_a_batch_runs_and_a_request_the_server_refuses_goes_to_the_error_file(stack: Stack) -> None:
    # Given an input file of 12 requests and one whose prompt is over the server's context
    client = stack.client()
    long_prompt = [{"role": "user", "content": "word " * (2 * CONTEXT)}]
    lines = [line(i) for i in range(12)] + [
        {**line(99), "body": {**line(99)["body"], "messages": long_prompt}}
    ]
    # When it runs as a batch through the openai SDK
    batch = run_batch(client, lines)
    assert batch.status == "validating" and batch.endpoint == "/v1/chat/completions"
    done = wait_status(client, batch.id, ("completed", "failed"))
    # Then it completed, its counts from the ledger, its object OpenAI's Batch as served
    assert done.status == "completed", done.errors
    assert Batch.model_validate(raw_batch(stack, batch.id)).id == batch.id
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (13, 12, 1)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    # the 12 answers are in the output file, exact; the refused one in the error file with its 400
    check_outputs(content(client, done.output_file_id), range(12))
    (refused,) = content(client, done.error_file_id)
    assert refused["custom_id"] == "req-99" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["code"] == "context_length"
    out = client.files.retrieve(done.output_file_id or "")
    assert out.purpose == "batch_output" and out.bytes > 0
    # the batch is listed, and it is an ordinary run to the CLI
    assert batch.id in [b.id for b in client.batches.list(limit=10)]
    status = orjson.loads(cli("status", "--run", batch.id, "--json", env=stack.env).stdout)
    assert status["totals"]["done"] == 12 and status["totals"]["failed"] == 1
    with Client(redis_url=stack.env["TOKENMILL_REDIS_URL"]) as tm:
        assert tm.status(batch.id).totals["done"] == 12


def test_the_readme_drop_in_code_runs_a_batch(stack: Stack, tmp_path: Path) -> None:
    # Given the README's code, pointed at this API, and a Batch input file
    (tmp_path / "batch_input.jsonl").write_bytes(jsonl([line(i) for i in range(500, 505)]))
    code = DROP_IN.replace("http://127.0.0.1:8090/v1", stack.url).replace('"k1"', repr(KEYS[0]))
    # When it runs (polling faster than the README's ten seconds)
    done = subprocess.run(
        [sys.executable, "-c", code.replace("time.sleep(10)", "time.sleep(0.1)")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
    )
    # Then it printed a completed batch and its output lines
    assert done.returncode == 0, done.stderr
    status, *out = done.stdout.splitlines()
    assert status.startswith("completed")
    check_outputs([orjson.loads(x) for x in out if x], range(500, 505))


def test_a_file_with_malformed_lines_fails_in_validation_naming_each_and_runs_nothing(stack: Stack) -> None:
    # Given a file whose lines 2, 4, 5 and 6 are bad: not JSON, another endpoint, a bad body,
    # a custom_id seen before
    client = stack.client()
    lines = [
        line(0),
        b'{"custom_id": "x", "method": ',
        line(1),
        {**line(2), "url": "/v1/embeddings"},
        {**line(3), "body": {**line(3)["body"], "temperature": "hot"}},
        {**line(4), "custom_id": "req-1"},
        line(5),
    ]
    # When it is made a batch
    batch = run_batch(client, lines)
    failed = wait_status(client, batch.id, ("failed", "in_progress", "completed"))
    # Then the batch failed in validation, errors.data naming each bad line; nothing was enqueued
    assert failed.status == "failed" and failed.failed_at and failed.errors and failed.errors.data
    found = {(e.line, e.code) for e in failed.errors.data}
    assert found == {
        (2, "invalid_json_line"),
        (4, "invalid_url"),
        (5, "invalid_request"),
        (6, "duplicate_custom_id"),
    }
    assert "temperature" in next(e.message or "" for e in failed.errors.data if e.line == 5)
    assert not stack.redis.sismember(keys.runs(), batch.id)
    assert failed.output_file_id is None and failed.request_counts and failed.request_counts.total == 0


def test_a_wrong_key_a_missing_id_and_a_bad_request_get_openai_errors(stack: Stack) -> None:
    # Given an API that takes keys
    client = stack.client(KEYS[0])
    # Then a wrong key is a 401 invalid_api_key, in OpenAI's shape
    with pytest.raises(openai.AuthenticationError) as denied:
        stack.client("not-a-key").batches.list()
    assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
    assert set(orjson.loads(denied.value.response.content)["error"]) == {"message", "type", "param", "code"}
    # a missing file or batch a 404
    with pytest.raises(openai.NotFoundError) as missing:
        client.files.retrieve("file-0000")
    assert "file-0000" in missing.value.message
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-0000", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_0000")
    # another endpoint, a bad window, a file over the size limit: 400s and a 413 naming the field
    f = upload(client, [line(0)])
    with pytest.raises(openai.BadRequestError) as wrong:
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert wrong.value.param == "endpoint"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon")
    assert window.value.param == "completion_window"  # type: ignore[attr-defined]
    with pytest.raises(openai.APIStatusError) as big:
        client.files.create(file=("big.jsonl", b"x" * (5 << 20)), purpose="batch")
    assert big.value.status_code == 413
    # the models are what the server serves
    assert [m.id for m in client.models.list()] == ["sim-model"]
    # a method a route does not take is a 405; files are listed, read and deleted
    with pytest.raises(openai.APIStatusError) as method:
        client.put("/files", cast_to=object)
    assert method.value.status_code == 405
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert client.files.content(f.id).read() == jsonl([line(0)])
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)


def test_a_batch_survives_its_server_sigkilled_mid_run_with_one_exact_line_per_request(stack: Stack) -> None:
    # Given a batch running on the sim
    client = stack.client()
    batch = run_batch(client, [line(i) for i in range(40)])
    wait_some_done(client, batch.id)
    # When the sim is SIGKILLed mid-batch and another starts at its address
    stack.restart_sim()
    # Then the batch completes with every request answered once, exactly
    done = wait_status(client, batch.id, ("completed",))
    check_outputs(content(client, done.output_file_id), range(40))
    assert done.error_file_id is None


def test_a_batch_survives_the_api_killed_mid_run_and_two_restarted_ones_end_it_once(stack: Stack) -> None:
    # Given a batch in progress
    client = stack.client()
    batch = run_batch(client, [line(i) for i in range(100, 140)])
    wait_some_done(client, batch.id)
    # When the API process is SIGKILLed, and two start again (the same port and another)
    assert stack.api is not None
    stack.api.proc.send_signal(signal.SIGKILL)
    stack.api.proc.wait(10)
    assert stack.redis.hget(keys.api_batch(batch.id), "status") == b"in_progress"
    other = free_port()
    stack.api = stack.start_api()
    stack.start_api(other)
    # Then the batch ends once: completed, one output file, each request's line in it exactly once
    done = wait_status(client, batch.id, ("completed",))
    check_outputs(content(client, done.output_file_id), range(100, 140))
    outputs = [f for f in client.files.list(purpose="batch_output") if f.filename.startswith(batch.id)]
    assert [f.id for f in outputs] == [done.output_file_id]
    again = OpenAI(base_url=f"http://127.0.0.1:{other}/v1", api_key=KEYS[0]).batches.retrieve(batch.id)
    assert again.completed_at == done.completed_at


def test_a_batch_survives_redis_sigkilled_mid_run_and_restarted_from_its_aof(
    stack: Stack, redis_server: RedisServer
) -> None:
    # Given a batch in progress
    client = stack.client()
    batch = run_batch(client, [line(i) for i in range(400, 440)])
    wait_some_done(client, batch.id)
    # When redis-server is SIGKILLed, stays down while the API answers 503 and its loop finds it
    # gone, and starts again from its AOF
    redis_server.kill(signal.SIGKILL)

    def unavailable() -> bool:
        with pytest.raises(openai.InternalServerError) as down:
            client.batches.retrieve(batch.id)
        assert down.value.status_code == 503 and "Redis" in down.value.message
        return "cannot list active batches" in stack.api.output()  # type: ignore[union-attr]

    wait_for(unavailable, 30, "the API to find Redis gone")
    redis_server.start()
    # Then the batch completes, each request's line once and exact
    done = wait_status(client, batch.id, ("completed",), timeout=120)
    check_outputs(content(client, done.output_file_id), range(400, 440))


def test_a_batch_cancelled_mid_run_keeps_what_was_done_and_cancels_the_rest(stack: Stack) -> None:
    # Given a batch in progress
    client = stack.client()
    batch = run_batch(client, [line(i) for i in range(200, 240)])
    wait_some_done(client, batch.id)
    # When it is cancelled
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    # Then it ends cancelled: the done requests in the output file, exact; the rest cancelled
    ended = wait_status(client, batch.id, ("cancelled",))
    out, errors = content(client, ended.output_file_id), content(client, ended.error_file_id)
    done_ids = {o["custom_id"] for o in out}
    assert errors and all(e["error"]["code"] == "batch_cancelled" for e in errors)
    assert len(out) + len(errors) == 40 and done_ids.isdisjoint(e["custom_id"] for e in errors)
    assert ended.request_counts and ended.request_counts.completed == len(out)
    for o in out:
        assert o["response"]["body"]["choices"][0]["message"]["content"] == expected(int(o["custom_id"][4:]))


def test_a_batch_past_its_completion_window_ends_expired_keeping_what_was_done(stack: Stack) -> None:
    # Given a batch whose window (a tokenmill extension: any duration) ends before it can finish
    client = stack.client()
    batch = run_batch(client, [line(i) for i in range(300, 360)], window="2s")
    # Then it ends expired: the done requests in the output file, the rest batch_expired
    ended = wait_status(client, batch.id, ("expired", "completed"))
    assert ended.status == "expired" and ended.expired_at and ended.expires_at
    out, errors = content(client, ended.output_file_id), content(client, ended.error_file_id)
    assert errors and all(e["error"]["code"] == "batch_expired" for e in errors)
    assert len(out) + len(errors) == 60


def test_batches_are_listed_newest_first_a_page_at_a_time(stack: Stack) -> None:
    # Given the batches the tests above made, and three more
    client = stack.client()
    newest = [run_batch(client, [line(i)]) for i in range(3)][-1]
    # When they are listed two at a time (the SDK follows `after` from page to page)
    first = client.batches.list(limit=2)
    listed = [b.id for b in client.batches.list(limit=2)]
    # Then every batch is listed once, newest first
    assert first.has_more and len(first.data) == 2 and listed[0] == newest.id
    assert listed == [i.decode() for i in stack.redis.zrevrange(keys.api_batches(), 0, -1)]
    assert len(listed) >= 3
    with pytest.raises(openai.NotFoundError):
        client.batches.list(after="batch_0000")


def test_files_and_a_batch_stream_through_an_s3_store(stack: Stack, s3_env: dict[str, str]) -> None:
    # Given an API whose result store is a bucket of a real S3 server (the only API running)
    import fsspec

    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("api-files")
    for p in stack.procs:
        if p.proc.args[3:4] == ["api"]:
            p.kill()
    stack.api = stack.start_api(env={**s3_env, "TOKENMILL_RESULTS_URL": "s3://api-files/tm"})
    client = stack.client()
    # When a file of several chunks goes in, and a batch runs
    big = jsonl([{**line(600), "note": "x" * (3 << 20)}] + [line(i) for i in range(601, 605)])
    f = client.files.create(file=("big.jsonl", big), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_status(client, batch.id, ("completed", "failed"))
    # Then the file comes back byte for byte, and the batch's output is in the bucket
    assert client.files.content(f.id).read() == big
    assert done.status == "completed", done.errors
    check_outputs(content(client, done.output_file_id), range(600, 605))
    assert fsspec.filesystem("s3", skip_instance_cache=True).exists(f"api-files/tm/_api/files/{f.id}.jsonl")


def test_a_batch_moves_from_a_status_once_whoever_races_for_it(stack: Stack) -> None:
    # Given a batch record, validating (in another database: no API process advances it)
    other_db = redis.Redis.from_url(stack.env["TOKENMILL_REDIS_URL"].rsplit("/", 1)[0] + "/1")
    batches = Batches(other_db)
    batch_id = batches.create("file-x", "24h", None)
    # When two callers move it from validating, and one tries from a status it is not in
    moves = [batches.move(batch_id, ("validating",), "in_progress", in_progress_at=1) for _ in range(2)]
    # Then one of them moved it, and a move from elsewhere changed nothing
    assert moves == [True, False]
    assert not batches.move(batch_id, ("validating", "finalizing"), "failed")
    assert batches.move(batch_id, ("in_progress",), "cancelled") and batch_id not in batches.active()
    assert batches.fields(batch_id)["status"] == "cancelled"  # type: ignore[index]


def test_api_keys_live_under_the_shared_prefix() -> None:
    for key in (
        keys.api_file("file-a"),
        keys.api_files(),
        keys.api_batch("batch_a"),
        keys.api_batches(),
        keys.api_active(),
        keys.api_batch_lock("batch_a"),
    ):
        assert key.startswith("tm:_:api:")


def test_binding_beyond_loopback_needs_keys() -> None:
    # Given no TOKENMILL_API_KEYS, when the API is to listen on every interface, it refuses
    env = {"TOKENMILL_REDIS_URL": "redis://127.0.0.1:1/0", "TOKENMILL_API_KEYS": ""}
    res = cli("api", "--address", "0.0.0.0", "--port", str(free_port()), env=env, check=False, timeout=30)
    assert res.returncode == 2 and "TOKENMILL_API_KEYS" in res.stderr
