"""Sealing: done results move into shards, Redis keeps a few bytes per job, and the export is the
same file, row for row; lost shards are named and repaired; runs are deleted safely.

Jobs are finished through the ledger's own claim and commit with the sim's output
(``tests/finishing.py``); every command runs as a real ``tokenmill`` process against the
session's redis-server.
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from producer.export import export_row
from producer.export_parquet import ParquetRows
from producer.export_rows import RowCounts, ShardReader, partition_rows
from producer.result_store import ResultStore
from producer.sealing import Sealer, new_shard_id
from tests import sealing
from tests.finishing import all_job_ids, finish_jobs
from tests.pipeline import cli, write_jsonl
from tokenmill import keys
from tokenmill import transitions as t
from tokenmill.errors import ExportError
from tokenmill.ledger import Ledger
from tokenmill.transitions import Claim

SIZES = {"B1": 250, "B2": 150}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def env(redis_url: str, store: Path) -> dict[str, str]:
    return sealing.sealing_env(redis_url, store, seal_batch_jobs=100)


def shard_files(store: Path, run: str) -> list[Path]:
    return sorted(p for p in (store / run).glob("*/*.parquet"))


def test_sealed_jobs_keep_only_their_state_hash_and_shard_and_the_export_is_byte_identical(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], store: Path
) -> None:
    # Given a run of 400 done jobs in two partitions, exported while every result is in Redis:
    # what tokenmill exported before sealing existed
    assert sealing.done_run(tmp_path, rclient, env, "r", SIZES) == 400
    before = sealing.export(env, "r", tmp_path / "before")
    assert before == sealing.export_as_before_sealing(rclient, "r")
    before_pq = sealing.export(env, "r", tmp_path / "before-pq", "--format", "parquet")
    bytes_done = sealing.run_key_bytes(rclient, "r")

    # When the sealer runs (the partitions have nothing left to run: everything is due)
    out = sealing.seal(env)

    # Then every job is sealed into shards of at most 100 rows, Parquet files in the store
    assert "sealed 400 result(s) into 5 shard(s)" in out, out
    assert len(shard_files(store, "r")) == 5
    assert len(list((store / "r").glob("*/_specs/*.parquet"))) == 5
    assert sealing.job_states(rclient, "r") == {"sealed": 400}
    # and each job hash keeps its state, content hash and shard id, and nothing else
    k = keys.RunKeys("r")
    job_id = all_job_ids(rclient, "r")[0]
    job = rclient.hgetall(k.job(job_id))
    assert set(job) == {b"state", b"hash", b"shard"} and job[b"hash"] == job_id.encode()
    assert rclient.object("encoding", k.job(job_id)) == b"listpack"
    # and the run's keys hold at most 300 bytes a job (they held far more while done)
    per_job = sealing.run_key_bytes(rclient, "r") / 400
    assert per_job <= 300, f"{per_job:.0f} bytes per sealed job (done: {bytes_done / 400:.0f})"
    # and status still counts them as done, with the sealing figures beside
    status = orjson.loads(cli("status", "--run", "r", "--json", env=env).stdout)
    assert status["totals"]["done"] == 400 and status["partitions"]["B1"]["done"] == 250
    assert status["results"]["sealed"] == {"B1": 250, "B2": 150} and status["results"]["shards"] == 5
    assert status["results"]["store"] == str(store)

    # And the export from the shards is the export from Redis, byte for byte, in both formats
    assert sealing.export(env, "r", tmp_path / "after") == before
    after_pq = sealing.export(env, "r", tmp_path / "after-pq", "--format", "parquet")
    assert {n: pq.read_table(tmp_path / "after-pq" / n).to_pylist() for n in after_pq} == {
        n: pq.read_table(tmp_path / "before-pq" / n).to_pylist() for n in before_pq
    }


def test_the_parquet_export_holds_the_jsonl_rows_as_typed_columns(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str]
) -> None:
    sealing.done_run(tmp_path, rclient, env, "r", {"B1": 60})
    sealing.seal(env)
    jsonl = [orjson.loads(x) for x in sealing.export(env, "r", tmp_path / "j")["B1.jsonl"].splitlines()]
    sealing.export(env, "r", tmp_path / "p", "--format", "parquet")
    table = pq.read_table(tmp_path / "p" / "B1.parquet")
    assert table.schema.field("messages").type.value_type.names == [
        "role",
        "content",
        "reasoning_content",
        "name",
        "tool_call_id",
        "tool_calls",
    ]
    rows = table.to_pylist()
    assert len(rows) == len(jsonl) == 60
    for row, want in zip(rows, jsonl, strict=True):
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        got = {k: v for k, v in row.items() if v is not None}  # columns a row lacks are null
        assert {**got, "messages": messages, "metadata": orjson.loads(row["metadata"])} == want


def test_the_parquet_export_types_new_fields_and_refuses_a_message_it_cannot_hold(tmp_path: Path) -> None:
    # A field the export row gains (issue: `sample`) becomes a typed column
    path = tmp_path / "ok.parquet"
    with ParquetRows(str(path)) as out:
        for i in range(3):
            out.write(
                orjson.dumps({"id": f"a{i}", "messages": [{"role": "user", "content": "hi"}], "sample": i})
            )
    table = pq.read_table(path)
    assert table.schema.field("sample").type == pa.int64() and table.column("sample").to_pylist() == [0, 1, 2]
    # A message whose content is a list of parts does not fit the typed column: the job is named
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    with pytest.raises(ExportError, match=r"job 'b7': messages\[0\]\.content \(list\).*--format jsonl"):
        with ParquetRows(str(tmp_path / "bad.parquet")) as out:
            out.write(orjson.dumps({"id": "b7", "messages": [parts]}))


def test_a_partition_still_running_is_sealed_in_full_batches_then_once_its_oldest_waited(
    tmp_path: Path, rclient: redis.Redis, redis_url: str, store: Path
) -> None:
    # Given 250 jobs of which 230 are done and 20 still queued (the partition is not finished)
    env = sealing.sealing_env(redis_url, store, seal_batch_jobs=100, seal_after_s=3600)
    sealing.enqueue_run(tmp_path, env, "r", {"P": 250})
    finish_jobs(rclient, "r", all_job_ids(rclient, "r")[:230], mean_output_tokens=sealing.MEAN)

    # When the sealer runs: only full batches of 100 are due
    assert "sealed 200 result(s) into 2 shard(s)" in sealing.seal(env)
    assert sealing.job_states(rclient, "r") == {"sealed": 200, "done": 30, "queued": 20}
    # and the 30 left wait for the batch to fill or for seal_after_s
    assert "sealed 0 result(s)" in sealing.seal(env)
    assert "sealed 30 result(s) into 1 shard(s)" in sealing.seal({**env, "TOKENMILL_SEAL_AFTER_S": "0"})
    assert sealing.job_states(rclient, "r") == {"sealed": 230, "queued": 20}


def test_a_reserve_sent_again_after_redis_ran_it_returns_the_same_jobs_and_loses_none(
    tmp_path: Path, rclient: redis.Redis, redis_url: str, store: Path
) -> None:
    # Given 250 done jobs, and a shard reserved once (Redis ran the call, then died before it
    # answered: redis-py sends the call again, the same shard id, once Redis is back)
    env = sealing.sealing_env(redis_url, store, seal_batch_jobs=100)
    sealing.done_run(tmp_path, rclient, env, "r", {"P": 250})
    k = keys.RunKeys("r")
    sealer = Sealer(rclient, ResultStore(str(store)), batch_jobs=100, after_s=3600)
    shard = new_shard_id()
    first = sealer.reserve("r", "P", shard, force=False)

    # When the same call comes again
    again = sealer.reserve("r", "P", shard, force=False)

    # Then it answers the jobs of the first and leaves the other 150 waiting
    assert first[0] == again[0] == "ok" and orjson.loads(again[1]) == orjson.loads(first[1])
    assert len(orjson.loads(first[1])) == 100 and rclient.zcard(k.unsealed("P")) == 150
    # and the sealer then seals every job once (the reserved shard completed as a pending one)
    sealing.seal({**env, "TOKENMILL_SEAL_AFTER_S": "0"})
    assert sealing.job_states(rclient, "r") == {"sealed": 250}
    assert sealing.sealed_count(rclient, "r") == 250


def test_an_export_of_a_half_sealed_run_equals_the_export_of_an_unsealed_one(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str]
) -> None:
    # Given the same rows in two runs: one all done in Redis, the other with every other job
    # sealed before the rest were done (so sealed and Redis rows interleave in enqueue order)
    sealing.done_run(tmp_path, rclient, env, "plain", {"B1": 200})
    sealing.enqueue_run(tmp_path, env, "mixed", {"B1": 200})
    ids = all_job_ids(rclient, "mixed")
    finish_jobs(rclient, "mixed", ids[::2], mean_output_tokens=sealing.MEAN)
    sealing.seal(env, "--run", "mixed", "--all")
    finish_jobs(rclient, "mixed", ids[1::2], mean_output_tokens=sealing.MEAN)
    assert sealing.job_states(rclient, "mixed") == {"sealed": 100, "done": 100}

    # Then both exports are the same bytes
    assert sealing.export(env, "mixed", tmp_path / "m") == sealing.export(env, "plain", tmp_path / "p")


def test_a_shard_sealed_while_an_export_walks_is_read_from_that_shard(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], store: Path
) -> None:
    # Given an export that checked the partition's shards when there were none
    sealing.done_run(tmp_path, rclient, env, "r", {"B1": 120})
    want = sealing.export(env, "r", tmp_path / "ref")["B1.jsonl"]
    ledger = Ledger(rclient, "r")
    reader = ShardReader(ResultStore(str(store)), "r", "B1")
    counts = RowCounts()

    # When the run is sealed before the walk starts reading
    sealing.seal(env)

    # Then the walk opens the new shards as it meets their jobs, and reads every row from them
    rows = partition_rows(ledger, reader, counts, export_row)
    assert b"".join(line.row + b"\n" for line in rows) == want
    assert counts.from_shards == 120 and counts.from_redis == 0


def test_a_sealed_job_stays_deduplicated_and_a_late_message_for_it_is_a_no_op(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str]
) -> None:
    # Given a sealed run of rows with their own ids
    rows = [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(20)]
    data = write_jsonl(tmp_path / "P.jsonl", rows)
    cli("enqueue", str(data), "--run", "r", env=env)
    finish_jobs(rclient, "r", mean_output_tokens=sealing.MEAN)
    sealing.seal(env)
    shard = rclient.hget(keys.RunKeys("r").job("P:q3"), "shard").decode()

    # When the same file is enqueued again, and a row reuses an id with another prompt
    again = cli("enqueue", str(data), "--run", "r", env=env).stdout
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"id": "q3", "prompt": "something else"}])
    res = cli("enqueue", str(clash), "--run", "r", "--partition", "P", env=env, check=False)

    # Then the sealed jobs count as done, and the conflict names the shard holding the first one
    assert "0 new" in again and "20 already done" in again, again
    assert res.returncode == 1 and f"sealed shard {shard}" in res.stderr, res.stderr
    # and a late delivery of a sealed job claims nothing
    ledger = Ledger(rclient, "r")
    assert ledger.call(t.claim(ledger.k, "P:q3", "late-worker", 30)) == "done"
    assert ledger.call(t.peek(ledger.k, "P:q3")) is None
    assert sealing.job_states(rclient, "r") == {"sealed": 20}


def _damage(path: Path, how: str) -> None:
    if how == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 200] = bytes(200)
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["missing", "corrupt"])
def test_a_lost_shard_is_named_with_its_jobs_and_repair_brings_every_row_back(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], store: Path, how: str
) -> None:
    # Given a sealed run and its export
    sealing.done_run(tmp_path, rclient, env, "r", SIZES)
    before = sealing.export(env, "r", tmp_path / "before")
    sealing.seal(env)
    victim = shard_files(store, "r")[1]
    shard_id = victim.stem
    held = [
        j
        for j in all_job_ids(rclient, "r")
        if rclient.hget(keys.RunKeys("r").job(j), "shard") == shard_id.encode()
    ]
    assert len(held) == 100

    # When one shard file is lost (deleted, or damaged in the middle)
    _damage(victim, how)

    # Then the export stops, naming the shard, its file, how many jobs it held and which
    res = cli("export", "--run", "r", "--out", str(tmp_path / "lost"), env=env, check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"shard {shard_id}: {victim}" in res.stderr and "it held 100 job(s)" in res.stderr, res.stderr
    assert held[0] in res.stderr and "tokenmill repair --run r" in res.stderr
    assert not (tmp_path / "lost" / "B1.jsonl").exists() and not (tmp_path / "lost" / "B2.jsonl").exists()

    # When repair runs, its jobs are queued again with their prompts, and nothing else moved
    out = cli("repair", "--run", "r", env=env).stdout
    assert f"shard {shard_id}:" in out and "100 job(s) put back to queued" in out, out
    assert sealing.job_states(rclient, "r") == {"sealed": 300, "queued": 100}
    status = orjson.loads(cli("status", "--run", "r", "--json", env=env).stdout)
    assert status["totals"]["queued"] == 100 and status["totals"]["done"] == 300
    assert "0 lost" in cli("repair", "--run", "r", env=env).stdout  # a second repair finds nothing

    # And once they are generated and sealed again, the export is the first one, byte for byte
    assert finish_jobs(rclient, "r", held, mean_output_tokens=sealing.MEAN) == 100
    sealing.seal(env)
    assert sealing.export(env, "r", tmp_path / "after") == before


def test_a_store_not_found_at_its_recorded_path_is_refused_not_repaired(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], store: Path
) -> None:
    # Given a sealed run whose store was moved away from the path the ledger recorded
    sealing.done_run(tmp_path, rclient, env, "r", {"B1": 120})
    before = sealing.export(env, "r", tmp_path / "before")
    sealing.seal(env)
    store.rename(tmp_path / "moved")

    # Then export and repair refuse, naming the path, and repair requeues nothing
    for args in (["export", "--out", str(tmp_path / "x")], ["repair"]):
        res = cli(*args, "--run", "r", env=env, check=False)
        assert res.returncode == 2 and f"{store / 'r'} does not exist here" in res.stderr, res.stderr
    assert sealing.job_states(rclient, "r") == {"sealed": 120}
    # and with --results-url the export reads the moved shards
    moved = sealing.export(env, "r", tmp_path / "after", "--results-url", str(tmp_path / "moved"))
    assert moved == before


def test_repair_names_the_jobs_it_cannot_regenerate_when_the_spec_file_is_lost_too(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], store: Path
) -> None:
    sealing.done_run(tmp_path, rclient, env, "r", {"B1": 120})
    sealing.seal(env)
    victim = shard_files(store, "r")[0]
    victim.unlink()
    (victim.parent / "_specs" / victim.name).unlink()

    res = cli("repair", "--run", "r", env=env, check=False)

    assert res.returncode == 1
    assert f"shard {victim.stem}: 100 job(s) cannot be generated again" in res.stdout, res.stdout
    assert sealing.job_states(rclient, "r") == {"sealed": 120}
    assert cli("export", "--run", "r", "--out", str(tmp_path / "x"), env=env, check=False).returncode == 2


def test_delete_refuses_while_a_worker_holds_a_job_unless_forced_and_results_removes_the_shards(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], store: Path
) -> None:
    # Given a sealed run with one more job a worker is running under a live lease
    sealing.done_run(tmp_path, rclient, env, "r", {"B1": 120})
    sealing.seal(env)
    cli("enqueue", str(write_jsonl(tmp_path / "more.jsonl", [{"prompt": "one more"}])), "--run", "r", env=env)
    job_id = next(
        j for j in all_job_ids(rclient, "r") if rclient.hget(keys.RunKeys("r").job(j), "state") == b"queued"
    )
    busy = Ledger(rclient, "r")
    assert isinstance(busy.call(t.claim(busy.k, job_id, "busy-worker", 60)), Claim)

    # When it is deleted without --force, it is refused, naming what holds it
    res = cli("delete", "--run", "r", env=env, check=False)
    assert res.returncode == 2 and "1 job(s) running under a live lease" in res.stderr, res.stderr
    assert rclient.exists(keys.RunKeys("r").counts())

    # With --force (and --results) every key of the run and every shard is gone
    out = cli("delete", "--run", "r", "--force", "--results", env=env).stdout
    assert re.search(r"deleted \d+ key\(s\) and 4 file\(s\) under " + re.escape(str(store)), out), out
    assert list(rclient.scan_iter(match="tm:r:*")) == []
    assert not rclient.sismember(keys.runs(), "r")
    assert not (store / "r").exists()
    res = cli("status", "--run", "r", env=env, check=False)
    assert res.returncode != 0 and "no run named 'r'" in res.stderr


def test_delete_without_results_keeps_the_shards_and_says_where(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], store: Path
) -> None:
    sealing.done_run(tmp_path, rclient, env, "r", {"B1": 30})
    sealing.seal(env)
    out = cli("delete", "--run", "r", env=env).stdout
    assert f"its shards stay in {store}" in out, out
    assert len(shard_files(store, "r")) == 1


def test_a_sealer_with_another_store_leaves_the_run_to_the_store_it_started_in(
    tmp_path: Path, rclient: redis.Redis, env: dict[str, str], store: Path
) -> None:
    # Given a run sealed into one store, with a seal of it left half done (its sealer died)
    sealing.done_run(tmp_path, rclient, env, "r", {"B1": 150})
    sealing.seal({**env, "TOKENMILL_SEAL_AFTER_S": "3600"}, "--run", "r")
    cli("enqueue", str(write_jsonl(tmp_path / "x.jsonl", [{"prompt": "late"}])), "--run", "r", env=env)
    finish_jobs(rclient, "r", mean_output_tokens=sealing.MEAN)
    assert sealing.crash_sealer(env, "reserved", "--all") == "killed"

    # When a sealer configured with another store runs
    out = sealing.seal({**env, "TOKENMILL_RESULTS_URL": str(tmp_path / "elsewhere")}, "--all")

    # Then it leaves the run alone, half-done seal included, and says where its shards are
    assert f"its shards are in {store}" in out, out
    assert not (tmp_path / "elsewhere").exists()
    assert rclient.scard(keys.RunKeys("r").seals_pending()) == 1
    # and a sealer of the run's own store completes it
    assert "completed 1 half-done seal(s)" in sealing.seal(env)
    assert sealing.job_states(rclient, "r") == {"sealed": 151}


def test_bad_sealing_settings_are_refused_by_name(tmp_path: Path, redis_url: str) -> None:
    res = cli(
        "seal",
        "--once",
        env={"TOKENMILL_REDIS_URL": redis_url, "TOKENMILL_SEAL_BATCH_JOBS": "0"},
        check=False,
    )
    assert res.returncode == 2 and "seal_batch_jobs must be at least 1" in res.stderr, res.stderr
