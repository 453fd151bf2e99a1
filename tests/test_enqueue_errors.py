"""Bad input gets a clear error naming it, and nothing already enqueued is lost."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson
import redis

from producer.status import run_status
from tests.pipeline import cli, write_jsonl
from tests.procs import RedisServer, free_port


def totals(client: redis.Redis, run: str) -> dict[str, int]:
    return run_status(client, run)["totals"]


def test_malformed_json_line_stops_enqueue_naming_file_and_line(
    tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    f = tmp_path / "P.jsonl"
    f.write_bytes(b'{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": oops}\n{"prompt": "four"}\n')
    res = cli("enqueue", str(f), "--run", "r", env={"TOKENMILL_REDIS_URL": redis_url}, check=False)
    assert res.returncode == 2
    assert f"{f}:3: invalid JSON" in res.stderr
    # the rows before the bad line are enqueued, not lost
    assert totals(rclient, "r")["queued"] == 2
    skipped = cli("enqueue", str(f), "--run", "r", "--skip-invalid", env={"TOKENMILL_REDIS_URL": redis_url})
    assert (
        "1 new" in skipped.stdout and "1 invalid" in skipped.stdout and "2 already queued" in skipped.stdout
    )
    assert f"{f}:3" in skipped.stderr


def test_a_bad_row_after_many_batches_in_flight_keeps_every_row_before_it_in_file_order(
    tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    rows = [orjson.dumps({"id": i, "prompt": f"row {i}"}) for i in range(1, 1001)]
    rows[949] = b'{"prompt": oops}'  # line 950, after several batches were sent and not yet read
    f = tmp_path / "P.jsonl"
    f.write_bytes(b"\n".join(rows) + b"\n")

    res = cli("enqueue", str(f), "--run", "r", env={"TOKENMILL_REDIS_URL": redis_url}, check=False)

    assert res.returncode == 2 and f"{f}:950: invalid JSON" in res.stderr
    assert totals(rclient, "r")["queued"] == 949
    published = []
    while (raw := rclient.rpop("short")) is not None:  # workers take from the right
        published.append(orjson.loads(base64.b64decode(orjson.loads(raw)["body"]))[0][2])
    assert published == [f"P:{i}" for i in range(1, 950)]


def test_each_invalid_row_is_rejected_naming_the_row(tmp_path: Path, redis_url: str) -> None:
    cases = {
        '{"id": 1}': "neither",
        '{"messages": "hi"}': '"messages" must be a list',
        '{"messages": [{"role": "bot", "content": "x"}]}': "unknown role 'bot'",
        '{"messages": [{"role": "user", "content": ""}]}': "empty content",
        '{"prompt": "x", "max_tokens": -3}': '"max_tokens" must be a positive integer, got -3',
    }
    for i, (line, problem) in enumerate(cases.items()):
        f = tmp_path / f"bad{i}.jsonl"
        f.write_text('{"prompt": "fine"}\n' + line + "\n")
        res = cli("enqueue", str(f), "--run", "r", env={"TOKENMILL_REDIS_URL": redis_url}, check=False)
        assert res.returncode == 2, res
        assert f"{f}:2:" in res.stderr and problem in res.stderr, res.stderr


def test_same_id_with_different_content_is_reported_not_overwritten(
    tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    a = write_jsonl(tmp_path / "P.jsonl", [{"id": "x", "prompt": "first"}])
    b = tmp_path / "other"
    b.mkdir()
    b = write_jsonl(b / "P.jsonl", [{"id": "x", "prompt": "second"}])
    cli("enqueue", str(a), "--run", "r", env={"TOKENMILL_REDIS_URL": redis_url})
    res = cli("enqueue", str(b), "--run", "r", env={"TOKENMILL_REDIS_URL": redis_url}, check=False)
    assert res.returncode == 1
    assert f"{b}:1" in res.stderr and f"{a}:1" in res.stderr and "'P:x'" in res.stderr
    spec = orjson.loads(rclient.hget("tm:r:job:P:x", "spec"))
    assert spec["request"]["messages"][0]["content"] == "first"


def test_unreachable_or_refusing_redis_is_reported_with_the_url_redacted(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "P.jsonl", [{"prompt": "x"}])
    port = free_port()
    res = cli(
        "enqueue",
        str(f),
        "--run",
        "r",
        env={"TOKENMILL_REDIS_URL": f"redis://:s3cret@127.0.0.1:{port}/0"},
        check=False,
    )
    assert res.returncode == 2
    assert f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0" in res.stderr
    assert "s3cret" not in res.stderr
    guarded = RedisServer(tmp_path / "guarded", password="right").start()
    try:
        for url in (f"redis://:wrongpass@127.0.0.1:{guarded.port}/0", f"redis://127.0.0.1:{guarded.port}/0"):
            res = cli("enqueue", str(f), "--run", "r", env={"TOKENMILL_REDIS_URL": url}, check=False)
            assert res.returncode == 2, res
            assert "wrongpass" not in res.stderr and f"127.0.0.1:{guarded.port}" in res.stderr
            assert "password" in res.stderr, res.stderr
        ok = cli("enqueue", str(f), "--run", "r", env={"TOKENMILL_REDIS_URL": guarded.url})
        assert "1 new" in ok.stdout
    finally:
        guarded.kill()


def test_bad_run_name_and_unknown_flag_are_refused(tmp_path: Path, redis_url: str) -> None:
    f = write_jsonl(tmp_path / "P.jsonl", [{"prompt": "x"}])
    res = cli("enqueue", str(f), "--run", "a:b", env={"TOKENMILL_REDIS_URL": redis_url}, check=False)
    assert res.returncode == 2 and "--run 'a:b' is not a valid run name" in res.stderr
    res = cli("enqueue", str(f), "--run", "r", "--bogus", env={"TOKENMILL_REDIS_URL": redis_url}, check=False)
    assert res.returncode == 2 and "No such option '--bogus'" in res.stderr


def test_limit_caps_each_partition(tmp_path: Path, redis_url: str, rclient: redis.Redis) -> None:
    a = write_jsonl(tmp_path / "A.jsonl", [{"prompt": f"a{i}"} for i in range(10)])
    b = write_jsonl(tmp_path / "B.jsonl", [{"prompt": f"b{i}"} for i in range(10)])
    cli("enqueue", str(a), str(b), "--run", "r", "--limit", "3", env={"TOKENMILL_REDIS_URL": redis_url})
    parts = run_status(rclient, "r")["partitions"]
    assert parts["A"]["queued"] == 3 and parts["B"]["queued"] == 3


def test_parquet_and_hf_datasets_directories_enqueue_like_jsonl(
    tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": str(i), "prompt": f"question {i}", "max_tokens": 64} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "PQ.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "HF"))
    res = cli(
        "enqueue",
        str(tmp_path / "PQ.parquet"),
        str(tmp_path / "HF"),
        "--run",
        "r",
        env={"TOKENMILL_REDIS_URL": redis_url},
    )
    assert "60 new" in res.stdout, res.stdout
    parts = run_status(rclient, "r")["partitions"]
    assert parts["PQ"]["queued"] == 30 and parts["HF"]["queued"] == 30
    spec = orjson.loads(rclient.hget("tm:r:job:HF:7", "spec"))
    assert spec["request"]["max_tokens"] == 64 and spec["record_id"] == "7"


def test_a_10mb_row_and_non_utf8_bytes(tmp_path: Path, redis_url: str, rclient: redis.Redis) -> None:
    f = tmp_path / "P.jsonl"
    big = "x" * (10 * 1024 * 1024)
    f.write_bytes(orjson.dumps({"id": "big", "prompt": big}) + b"\n" + b'{"prompt": "caf\xe9"}\n')
    # (above the default bounds on a row and a prompt: tests/test_limits.py)
    bounds = {
        "TOKENMILL_INPUT_MAX_ROW_BYTES": str(16 << 20),
        "TOKENMILL_INPUT_MAX_PROMPT_BYTES": str(16 << 20),
    }
    res = cli("enqueue", str(f), "--run", "r", env={"TOKENMILL_REDIS_URL": redis_url, **bounds}, check=False)
    assert res.returncode == 2 and f"{f}:2: not valid UTF-8" in res.stderr
    spec = orjson.loads(rclient.hget("tm:r:job:P:big", "spec"))
    assert len(spec["request"]["messages"][0]["content"]) == len(big)
    # a 10 MB prompt is routed to the long queue
    assert rclient.hget("tm:r:job:P:big", "queue") == b"long"
