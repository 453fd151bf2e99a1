"""The result store and the shard format: whole-or-nothing writes, on a local disk and on a real
S3-compatible server (moto's server mode on loopback), and shards that read back as written."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest

from producer import shards
from producer.repair import shard_problem
from producer.result_store import ResultStore
from producer.shards import (
    ROW_GROUP_ROWS,
    ShardFile,
    ShardRow,
    SpecRow,
    read_specs,
    shard_bytes,
    specs_bytes,
)
from tokenmill.errors import ResultStoreError


class Crash(Exception):
    pass


def _crash_at(step: str) -> Callable[[str], None]:
    def hook(at: str) -> None:
        if at == step:
            raise Crash(at)

    return hook


def test_a_local_write_is_whole_or_absent_and_a_crash_leaves_only_a_hidden_temporary(tmp_path: Path) -> None:
    store = ResultStore(str(tmp_path / "store"))
    path = store.shard_path("r", "P", "s1")

    # When the writer dies after its temporary copy is durable, before the rename
    with pytest.raises(Crash):
        store.write(path, b"x" * 1000, _crash_at("tmp_written"))

    # Then the shard does not exist, and the temporary was removed on the way out
    assert not os.path.exists(path)
    assert [p.name for p in (tmp_path / "store" / "r" / "P").iterdir()] == []

    # And a process killed there (nothing cleans up) leaves a hidden temporary, which recovery
    # removes; a complete write then takes the final name
    leftover = Path(path).with_name(f".{Path(path).name}.dead.tmp")
    leftover.write_bytes(b"half")
    assert store.remove_temporaries("r", "P", "s1") == 1 and not leftover.exists()
    store.write(path, b"y" * 1000)
    assert Path(path).read_bytes() == b"y" * 1000
    assert store.url == str(tmp_path / "store")  # what the ledger records: an absolute path


def test_an_unknown_store_scheme_is_a_clear_error() -> None:
    with pytest.raises(ResultStoreError, match="nosuch://bucket"):
        ResultStore("nosuch://bucket/x")
    with pytest.raises(ResultStoreError, match="empty"):
        ResultStore(" ")


def test_shards_round_trip_in_seq_order_with_late_results_in_row_groups_of_their_own() -> None:
    # Given rows sealed out of order: one long-finished straggler, a run of 600, a late pair
    seqs = [5000, 5001, 3, *range(1000, 1600)]
    rows = [ShardRow(f"j{s}", s, s % 7 == 0, f'{{"id":"j{s}","t":"日本🙂"}}'.encode()) for s in seqs]

    shard = ShardFile("s", io.BytesIO(shard_bytes(rows)))

    # Then rows come back sorted by seq, byte for byte, each row group a narrow seq range
    back = list(shard.iter_rows())
    assert back == sorted(rows, key=lambda r: r.seq)
    assert shard.rows == len(rows)
    spans = [(g.min_seq, g.max_seq) for g in shard.groups]
    assert spans[0] == (3, 3) and spans[-1] == (5000, 5001)
    assert all(g.rows <= ROW_GROUP_ROWS for g in shard.groups)


def test_spec_files_round_trip() -> None:
    specs = [
        SpecRow("a", 0, "short", "h" * 32, "f.jsonl:1", b'{"request":{}}'),
        SpecRow("b", 9, "long", "", "", b"{}"),
    ]
    assert read_specs(io.BytesIO(specs_bytes(specs))) == specs


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shard_does_not_read_back_silently(damage: str) -> None:
    rows = [ShardRow(f"j{i}", i, False, (b'{"text":"%d"}' % i) * 40) for i in range(300)]
    data = bytearray(shard_bytes(rows))
    if damage == "flip":
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    else:
        data = data[: len(data) // 2]
    with pytest.raises(Exception):  # noqa: B017 - pyarrow raises OSError or ArrowInvalid
        list(ShardFile("s", io.BytesIO(bytes(data))).iter_rows())


def test_a_byte_flipped_in_a_pages_payload_is_caught_by_its_checksum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a shard written uncompressed (so its rows' text lies in the file as is), in a store
    monkeypatch.setitem(shards._WRITE, "compression", "none")
    rows = [ShardRow(f"j{i}", i, False, b'{"text":"row %d of the shard"}' % i) for i in range(10)]
    data = bytearray(shard_bytes(rows))
    assert list(ShardFile("s", io.BytesIO(bytes(data))).iter_rows()) == rows  # whole, it reads back
    store = ResultStore(str(tmp_path / "store"))
    path = store.shard_path("r", "P", "s1")

    # When one bit of one row's text, inside a data page, is flipped ("row 7" becomes "row 6")
    at = data.index(b"row 7 of the shard") + len(b"row ")
    data[at] ^= 0x01
    store.write(path, bytes(data))

    # Then reading it fails on the page's checksum, and the repair check names the shard and why
    with pytest.raises(OSError, match=r"^could not verify page integrity, CRC checksum verification failed"):
        list(ShardFile("s1", io.BytesIO(bytes(data))).iter_rows())
    assert shard_problem(store, "r", "P", "s1", ["j7"]) == (
        f"{store.describe(path)} is unreadable (OSError: could not verify page integrity, "
        "CRC checksum verification failed for page_ordinal 0)"
    )


def test_the_s3_store_writes_reads_and_deletes_on_a_real_s3_server(s3_env: dict[str, str]) -> None:
    # Given a bucket on the loopback S3 server (credentials and endpoint from AWS_* variables)
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir("results-rw")
    store = ResultStore("s3://results-rw/prefix/")
    assert store.url == "s3://results-rw/prefix" and not store.local

    # When a shard and its spec file are written, one PUT each
    rows = [ShardRow(f"j{i}", i, i == 2, b'{"i":%d}' % i) for i in range(5)]
    store.write(store.shard_path("r", "P 1", "s1"), shard_bytes(rows))
    store.write(
        store.specs_path("r", "P 1", "s1"), specs_bytes([SpecRow("j0", 0, "short", "h", "src", b"{}")])
    )

    # Then they read back through the same store, and delete_run removes every object of the run
    with store.open(store.shard_path("r", "P 1", "s1")) as fh:
        assert list(ShardFile("s1", fh).iter_rows()) == rows
    assert store.describe(store.shard_path("r", "P 1", "s1")) == "s3://results-rw/prefix/r/P 1/s1.parquet"
    assert store.delete_run("r") == 2
    assert not store.exists(store.shard_path("r", "P 1", "s1"))
    with pytest.raises(FileNotFoundError):
        with store.open(store.shard_path("r", "P 1", "s1")):
            pass
