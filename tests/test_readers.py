"""Dataset readers: every format yields its rows with a source naming the file and the row."""

from __future__ import annotations

import gzip
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets  # a dev dependency: missing, the module fails to import (it never skips)
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producer.readers import Record, dataset_stem, iter_records, json_kind
from tokenmill.errors import InputError


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def dump(obj: Any) -> bytes:
    return orjson.dumps(obj)


def good(records: list[Record]) -> list[tuple[str, dict[str, Any] | None]]:
    return [(r.source, r.data) for r in records]


# --- JSONL ---------------------------------------------------------------------------------------


def test_jsonl_yields_each_object_with_its_line_number_and_skips_blank_lines(
    tmp_path: Path,
) -> None:
    path = write_lines(
        tmp_path / "rows.jsonl",
        [
            dump({"prompt": "héllo wörld ☃ 日本語 🚀"}),
            b"",
            b"   \t",
            dump({"messages": [{"role": "user", "content": "hi"}], "id": 7}) + b"\r",
        ],
    )

    records = list(iter_records(path))

    assert records == [
        Record(f"{path}:1", {"prompt": "héllo wörld ☃ 日本語 🚀"}),
        Record(f"{path}:4", {"messages": [{"role": "user", "content": "hi"}], "id": 7}),
    ]


def test_jsonl_accepts_a_str_path_and_a_leading_byte_order_mark(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + dump({"prompt": "a"})])

    assert good(list(iter_records(str(path)))) == [(f"{path}:1", {"prompt": "a"})]


def test_malformed_jsonl_line_is_a_record_error_with_its_line_number(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "bad.jsonl",
        [dump({"prompt": "ok"}), b'{"prompt": "x",, "id": 1}', b'{"prompt": "unterminated', b"{"],
    )

    records = list(iter_records(path))

    assert records[0] == Record(f"{path}:1", {"prompt": "ok"})
    assert [(r.source, r.data) for r in records[1:]] == [
        (f"{path}:2", None),
        (f"{path}:3", None),
        (f"{path}:4", None),
    ]
    assert records[1].error == "invalid JSON: unexpected character, expected a string key at column 16"
    assert records[2].error is not None and records[2].error.startswith("invalid JSON: ")
    assert records[3].error is not None and records[3].error.startswith("invalid JSON: ")


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (b"[1, 2]", "a list"),
        (b'"just a string"', "a string"),
        (b"42", "a number"),
        (b"true", "a boolean"),
        (b"null", "null"),
    ],
)
def test_jsonl_line_that_is_not_an_object_says_what_it_is(tmp_path: Path, line: bytes, kind: str) -> None:
    path = write_lines(tmp_path / "x.jsonl", [dump({"prompt": "first"}), line])

    records = list(iter_records(path))

    assert records[1] == Record(f"{path}:2", None, f"expected a JSON object, got {kind}")


def test_jsonl_line_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "latin1.jsonl",
        [dump({"prompt": "ok"}), b'{"prompt": "caf\xe9"}', dump({"prompt": "after"})],
    )

    records = list(iter_records(path))

    assert records[1] == Record(f"{path}:2", None, "not valid UTF-8 at byte 16 (0xe9)")
    assert records[2] == Record(f"{path}:3", {"prompt": "after"})


def test_a_10_mb_line_is_read_whole(tmp_path: Path) -> None:
    long_text = "ab" * (5 * 1024 * 1024)
    path = write_lines(
        tmp_path / "long.jsonl",
        [dump({"prompt": "short"}), dump({"prompt": long_text}), dump({"prompt": "next"})],
    )

    records = list(iter_records(path))

    assert [r.source for r in records] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    assert records[1].data == {"prompt": long_text}
    assert records[2].data == {"prompt": "next"}


def test_gzipped_jsonl_is_read_line_by_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(dump({"prompt": "ünï"}) + b"\n\n" + b"nope\n" + dump({"id": 2, "prompt": "b"}))

    records = list(iter_records(path))

    assert [r.source for r in records] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert records[0].data == {"prompt": "ünï"}
    assert records[1] == Record(
        f"{path}:3", None, "invalid JSON: invalid literal, expected 'null' at column 1"
    )
    assert records[2].data == {"id": 2, "prompt": "b"}


def test_a_gz_name_on_a_plain_file_is_refused_when_called(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "plain.jsonl.gz", [dump({"prompt": "a"})])

    with pytest.raises(InputError, match="not a gzip file") as info:
        iter_records(path)
    assert info.value.source == str(path)


def test_truncated_gzip_raises_naming_the_line_being_read(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl.gz"
    body = b"".join(dump({"prompt": f"row {i} " + "x" * 200}) + b"\n" for i in range(2000))
    path.write_bytes(gzip.compress(body)[:-2000])
    records = iter_records(path)

    with pytest.raises(InputError, match="gzip data is corrupt") as info:
        for _ in records:
            pass
    assert info.value.source.startswith(f"{path}:")


def test_a_pretty_printed_json_array_is_refused_with_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "array.json"
    path.write_bytes(orjson.dumps([{"prompt": "a"}], option=orjson.OPT_INDENT_2))

    with pytest.raises(InputError, match=r"looks like a JSON array, not JSON Lines") as info:
        list(iter_records(path))
    assert info.value.source == f"{path}:1"


# --- files that cannot be read at all -----------------------------------------------------------


def test_a_missing_file_is_refused_when_called_not_when_iterated(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"

    with pytest.raises(InputError) as info:
        iter_records(path)
    assert (info.value.source, info.value.problem) == (str(path), "no such file or directory")


def test_an_unknown_extension_is_refused_naming_the_known_formats(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("prompt\nhello\n")

    with pytest.raises(InputError) as info:
        iter_records(path)
    assert info.value.source == str(path)
    assert info.value.problem.startswith("unknown file format '.csv': expected .jsonl, .json")


def test_a_file_without_extension_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rows"
    path.write_text("{}\n")

    with pytest.raises(InputError, match=r"unknown file format '\(no extension\)'"):
        iter_records(path)


def test_a_corrupt_parquet_file_is_refused_when_called(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet at all")

    with pytest.raises(InputError, match="not a readable Parquet file") as info:
        iter_records(path)
    assert info.value.source == str(path)


def test_a_plain_directory_is_not_a_datasets_directory(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"not a Hugging Face datasets directory \(no state.json\)"):
        iter_records(tmp_path)


# --- Parquet -------------------------------------------------------------------------------------


def test_parquet_rows_become_dicts_numbered_from_one(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    rows = [
        {"messages": [{"role": "user", "content": "ça va ?"}], "id": "a", "max_tokens": 5},
        {
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "id": "b",
            "max_tokens": None,
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)

    records = list(iter_records(path))

    assert records == [Record(f"{path}:row 1", rows[0]), Record(f"{path}:row 2", rows[1])]


def test_a_parquet_file_under_a_folder_with_braces_names_its_rows_by_that_path(tmp_path: Path) -> None:
    # a row's name is the path, then the number: the path is not a format string
    path = tmp_path / "{run}" / "rows.parquet"
    path.parent.mkdir()
    pq.write_table(pa.Table.from_pylist([{"prompt": "p"}]), path)

    assert [r.source for r in iter_records(path)] == [f"{path}:row 1"]


def test_parquet_row_numbers_run_on_across_batches_and_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "many.parquet"
    n = 3000
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(n)]}), path, row_group_size=700)

    records = list(iter_records(path))

    assert [r.source for r in records] == [f"{path}:row {i}" for i in range(1, n + 1)]
    assert [r.data for r in records] == [{"prompt": f"p{i}"} for i in range(n)]


# --- Hugging Face datasets -----------------------------------------------------------------------


def save_dataset(rows: list[dict[str, Any]], path: Path, **kwargs: Any) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path), **kwargs)
    return path


def test_datasets_dir_rows_follow_state_json_across_shards(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "id": i, "metadata": {"k": i}} for i in range(10)]
    path = save_dataset(rows, tmp_path / "ds", num_shards=3)

    records = list(iter_records(path))

    assert records == [Record(f"{path}:row {i + 1}", row) for i, row in enumerate(rows)]


def test_datasets_shards_are_read_in_the_order_state_json_lists_them(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}"} for i in range(4)]
    path = save_dataset(rows, tmp_path / "ds", num_shards=2)
    state = orjson.loads((path / "state.json").read_bytes())
    state["_data_files"].reverse()
    (path / "state.json").write_bytes(orjson.dumps(state))

    records = list(iter_records(path))

    assert [r.data for r in records] == [rows[2], rows[3], rows[0], rows[1]]
    assert [r.source for r in records] == [f"{path}:row {i}" for i in range(1, 5)]


def test_datasets_dir_with_a_missing_shard_is_refused(tmp_path: Path) -> None:
    path = save_dataset([{"prompt": "a"}, {"prompt": "b"}], tmp_path / "ds", num_shards=2)
    (path / "data-00001-of-00002.arrow").unlink()

    with pytest.raises(InputError, match=r"missing: data-00001-of-00002\.arrow"):
        iter_records(path)


def test_datasets_dict_split_dir_is_read_and_root_names_the_splits(tmp_path: Path) -> None:
    root = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "t1"}, {"prompt": "t2"}]),
            "test": datasets.Dataset.from_list([{"prompt": "e1"}]),
        }
    ).save_to_disk(str(root))

    train = list(iter_records(root / "train"))
    with pytest.raises(InputError) as info:
        iter_records(root)

    assert train == [
        Record(f"{root / 'train'}:row 1", {"prompt": "t1"}),
        Record(f"{root / 'train'}:row 2", {"prompt": "t2"}),
    ]
    assert info.value.source == str(root)
    assert info.value.problem == (
        f"is a DatasetDict with splits 'train', 'test'; pass one split's directory, e.g. {root / 'train'}"
    )


def test_a_corrupt_arrow_shard_raises_naming_the_row_and_file(tmp_path: Path) -> None:
    path = save_dataset([{"prompt": "a"}, {"prompt": "b"}], tmp_path / "ds", num_shards=2)
    (path / "data-00001-of-00002.arrow").write_bytes(b"garbage" * 10)

    records = iter_records(path)
    assert next(records) == Record(f"{path}:row 1", {"prompt": "a"})
    with pytest.raises(InputError, match=r"Arrow read of data-00001-of-00002\.arrow failed") as info:
        next(records)
    assert info.value.source == f"{path}:row 2"


# --- memory: readers stream ----------------------------------------------------------------------


def peak_python_bytes(read: Iterator[Record], count: int | None) -> int:
    """Peak Python heap while taking ``count`` records from ``read`` (all if None)."""
    tracemalloc.start()
    try:
        for i, _ in enumerate(read, start=1):
            if count is not None and i >= count:
                break
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_first_record_of_a_200k_row_jsonl_does_not_read_the_file(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    line = dump({"prompt": "x" * 100}) + b"\n"
    path.write_bytes(line * 200_000)
    size = path.stat().st_size

    peak = peak_python_bytes(iter_records(path), count=1)

    assert size > 20_000_000
    assert peak < size / 50


def test_a_full_jsonl_pass_holds_one_line_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "wide.jsonl"
    line = dump({"prompt": "y" * 10_000}) + b"\n"
    path.write_bytes(line * 2000)
    size = path.stat().st_size

    peak = peak_python_bytes(iter_records(path), count=None)

    assert peak < size / 20


@pytest.mark.parametrize("fmt", ["parquet", "datasets"])
def test_first_record_of_a_500k_row_arrow_source_reads_one_row_group(tmp_path: Path, fmt: str) -> None:
    n = 500_000
    table = pa.table({"prompt": [f"{i:08d}" + "z" * 92 for i in range(n)]})
    data_bytes = table.nbytes
    if fmt == "parquet":
        path = tmp_path / "big.parquet"
        pq.write_table(table, path, row_group_size=5_000)
    else:
        path = tmp_path / "big_ds"
        datasets.Dataset(table).save_to_disk(str(path))
    del table
    before = pa.total_allocated_bytes()

    records = iter_records(path)
    first = next(records)
    held = pa.total_allocated_bytes() - before

    assert first == Record(f"{path}:row 1", {"prompt": "00000000" + "z" * 92})
    assert held < data_bytes / 8


# --- helpers -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "stem"),
    [
        ("a/b.jsonl", "b"),
        ("b.JSONL.GZ", "b"),
        ("c.json.gz", "c"),
        ("d.parquet", "d"),
        ("e.v2.json", "e.v2"),
    ],
)
def test_dataset_stem_drops_the_format_suffixes(name: str, stem: str) -> None:
    assert dataset_stem(name) == stem


def test_dataset_stem_of_a_directory_is_its_name(tmp_path: Path) -> None:
    (tmp_path / "train.v1").mkdir()
    assert dataset_stem(tmp_path / "train.v1") == "train.v1"


def test_json_kind_names_json_types() -> None:
    assert [json_kind(v) for v in ({}, [], "", 1, 1.5, False, None, b"")] == [
        "an object",
        "a list",
        "a string",
        "a number",
        "a number",
        "a boolean",
        "null",
        "a bytes",
    ]


def test_a_one_line_json_array_is_refused_with_the_same_hint(tmp_path: Path) -> None:
    path = tmp_path / "array.jsonl"
    path.write_bytes(orjson.dumps([{"prompt": "a"}, {"prompt": "b"}]) + b"\n")

    with pytest.raises(InputError, match=r"looks like a JSON array, not JSON Lines") as info:
        list(iter_records(path))
    assert info.value.source == f"{path}:1"
