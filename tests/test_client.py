"""The Python API (``tokenmill.Client``) against a real redis-server: the CLI's enqueue, dedup and
validation for every kind of input, the status document, wait, the export's rows from Redis and
sealed shards, runs, retry and cancel. This module imports only tokenmill's public names (the
test helpers finish jobs and run the CLI)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
import warnings
from pathlib import Path

import datasets
import orjson
import pandas as pd
import pytest
import redis

import tokenmill
from tests.finishing import all_job_ids, finish_jobs, job_request
from tests.pipeline import cli, read_export, without_nulls, write_jsonl
from tests.procs import ROOT
from tokenmill import (
    CancelSummary,
    Client,
    ConfigError,
    EnqueueResult,
    IdConflictError,
    InputError,
    MissingExtraError,
    RedisUnavailableError,
    RetrySummary,
    RunInfo,
    Status,
    WaitTimeoutError,
)

ROWS = [
    {"id": "a", "prompt": "first question", "topic": "x"},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "second"}]},
    {"prompt": "third", "max_tokens": 7, "metadata": {"k": [1, 2]}},
]


@pytest.fixture
def tm(redis_url: str) -> Client:
    with Client(redis_url=redis_url, server_url="http://127.0.0.1:9") as client:
        yield client


def test_every_public_name_loads_on_first_use_and_the_python_api_doc_lists_it() -> None:
    doc = (ROOT / "docs" / "python-api.md").read_text()
    for name in tokenmill.__all__:
        assert getattr(tokenmill, name) is not None
        if name != "__version__":
            assert f"`{name}" in doc, f"{name} is public but docs/python-api.md omits it"
    probe = (
        "import sys, tokenmill\n"
        "heavy = ('producer', 'redis', 'click', 'celery', 'orjson', 'rich')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert res.stdout.strip() == "[]", res.stdout + res.stderr  # `import tokenmill` loads nothing else


def test_dicts_a_dataframe_a_dataset_and_a_file_are_the_same_jobs_as_the_clis(
    tm: Client, tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    # Given the same three rows as dicts, a DataFrame, a Dataset and a JSONL file (a Dataset has
    # every column in every row: from_list takes the columns from the first row)
    path = write_jsonl(tmp_path / "P.jsonl", ROWS)
    columns = dict.fromkeys(k for row in ROWS for k in row)
    dataset = datasets.Dataset.from_list([{**columns, **row} for row in ROWS])
    dataset.save_to_disk(str(tmp_path / "P"))
    env = {"TOKENMILL_REDIS_URL": redis_url}
    cli("enqueue", str(path), "--run", "by-cli", "--short-max-tokens", "50", env=env)
    cli("enqueue", str(tmp_path / "P"), "--run", "by-cli-from-a-dataset", "--short-max-tokens", "50", env=env)

    # When each is enqueued into partition P of one run
    first = tm.enqueue(ROWS, run="api", partition="P", short_max_tokens=50)
    again = [
        tm.enqueue(pd.DataFrame(ROWS), run="api", partition="P", short_max_tokens=50),
        tm.enqueue(dataset, run="api", partition="P", short_max_tokens=50),
        tm.enqueue(path, run="api", short_max_tokens=50),  # a file: its stem names the partition
        tm.enqueue([str(path)], run="api", short_max_tokens=50),
    ]

    # Then the first made three jobs, every later one found them there, and they are the CLI's
    assert isinstance(first, EnqueueResult) and (first.new, first.existing) == (3, 0)
    assert first.new_by_queue == {"short": 3} and "3 new" in first.line
    assert [(r.new, r.existing) for r in again] == [(0, 3)] * 4
    assert all_job_ids(rclient, "api") == all_job_ids(rclient, "by-cli")
    assert all_job_ids(rclient, "api") == all_job_ids(rclient, "by-cli-from-a-dataset")
    assert sorted(tm.status("api").partitions) == ["P"]
    assert tm.enqueue([{"prompt": "fourth"}], run="api").new == 1  # no partition: "default"
    assert sorted(tm.status("api").partitions) == ["P", "default"]


def test_a_dataframes_missing_values_are_absent_fields_and_its_numpy_values_plain(
    tm: Client, rclient: redis.Redis
) -> None:
    df = pd.DataFrame(
        {
            "prompt": ["p0", "p1"],
            "seed": pd.array([3, None], dtype="Int64"),  # NA
            "temperature": [0.5, float("nan")],  # NaN
            "tag": ["t", None],  # None
        }
    )
    df["metadata"] = [{"n": 1}, {"n": 2}]
    df["stop_words"] = [pd.Series([1, 2]).to_numpy(), pd.Series([3]).to_numpy()]  # numpy arrays in cells
    assert tm.enqueue(df, run="r").new == 2
    same = [{"prompt": "p0", "seed": 3, "temperature": 0.5}, {"prompt": "p1"}]  # the jobs' requests
    assert (tm.enqueue(same, run="r").new, tm.enqueue(same, run="r").existing) == (0, 2)
    finish_jobs(rclient, "r", mean_output_tokens=10)
    rows = list(tm.results("r", include_truncated=True))
    assert [r["metadata"] for r in rows] == [
        {"n": 1, "tag": "t", "stop_words": [1, 2]},
        {"n": 2, "stop_words": [3]},
    ]


def test_a_dataframe_read_from_parquet_holds_numpy_arrays_and_enqueues_as_its_rows(
    tm: Client, tmp_path: Path
) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "q0"}], "grid": [[1, 2], [3]]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}], "grid": [[4]]},
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "f.parquet")
    df = pd.read_parquet(tmp_path / "f.parquet")
    assert type(df["messages"][0]).__module__ == "numpy"  # lists come back as numpy arrays
    assert tm.enqueue(df, run="r").new == 2
    assert tm.enqueue(rows, run="r").existing == 2


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda rows: rows, "rows[1]"),
        (lambda rows: pd.DataFrame(rows), "df.iloc[1]"),
        (lambda rows: datasets.Dataset.from_list(rows), "dataset[1]"),
    ],
    ids=["dicts", "dataframe", "dataset"],
)
def test_an_invalid_row_raises_the_clis_input_error_naming_it(tm: Client, make: object, where: str) -> None:
    rows = [{"prompt": "fine"}, {"prompt": "   "}, {"prompt": "after"}]
    with pytest.raises(InputError) as bad:
        tm.enqueue(make(rows), run="r")  # type: ignore[operator]
    assert bad.value.source == where and bad.value.problem == '"prompt" is empty'
    assert tm.status("r").totals["total"] == 1  # the row before it was enqueued
    skipped = tm.enqueue(make(rows), run="r", skip_invalid=True)  # type: ignore[operator]
    assert (skipped.new, skipped.existing, skipped.invalid) == (1, 1, 1)


def test_a_file_row_is_named_by_line_and_other_inputs_are_refused_by_name(tm: Client, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "F.jsonl", [{"prompt": "ok"}, {"messages": "no"}])
    with pytest.raises(InputError) as bad:
        tm.enqueue(path, run="r")
    assert bad.value.source == f"{path}:2" and "must be a list of messages" in bad.value.problem
    with pytest.raises(InputError, match="rows: expected dicts"):
        tm.enqueue({"prompt": "one dict"}, run="r")
    with pytest.raises(InputError, match=r"rows\[0\]: expected a dict, got a number"):
        tm.enqueue(iter([42]), run="r")
    with pytest.raises(InputError, match=r"rows\[1\]: a file path among rows"):
        tm.enqueue(iter([{"prompt": "p"}, "F.jsonl"]), run="r")
    with pytest.raises(InputError, match="no such file"):
        tm.enqueue(tmp_path / "missing.jsonl", run="r")


def test_an_id_enqueued_before_with_other_content_raises_after_the_rest_is_enqueued(tm: Client) -> None:
    tm.enqueue([{"id": "x", "prompt": "original"}], run="r")
    with pytest.raises(IdConflictError) as conflict:
        tm.enqueue([{"id": "x", "prompt": "changed"}, {"prompt": "new one"}], run="r")
    assert conflict.value.job_id == "default:x" and conflict.value.source == "rows[0]"
    assert "1 new" in "".join(conflict.value.__notes__)
    assert tm.status("r").totals["total"] == 2


def test_bad_options_are_refused_by_name(tm: Client) -> None:
    for kwargs, name in [
        ({"samples": 0}, "samples"),
        ({"short_max_tokens": -1}, "short_max_tokens"),
        ({"limit": True}, "limit"),
    ]:
        with pytest.raises(ConfigError, match=name):
            tm.enqueue([{"prompt": "p"}], run="r", **kwargs)  # type: ignore[arg-type]
    for kwargs, source in [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"params": {"top_k": 0}}, "params['top_k']"),
        ({"params": {"stream": True}}, "params['stream']"),
        ({"params": {"max_tokens": 9}}, "params['max_tokens']"),  # short_max_tokens= says it
        ({"params": {"no_such_option": 1}}, "params['no_such_option']"),
        ({"params": ["stop"]}, "params"),
    ]:
        with pytest.raises(InputError) as bad:
            tm.enqueue([{"prompt": "p"}], run="r", **kwargs)  # type: ignore[arg-type]
        assert bad.value.source == source, bad.value
    with pytest.raises(ConfigError, match="run"):
        tm.enqueue([{"prompt": "p"}], run="no spaces allowed")
    assert tm.runs() == []


def test_params_are_the_runs_request_options_as_the_clis_param(
    tm: Client, tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    # Given rows, one with a stop list of its own, enqueued by the CLI with --param and --samples
    rows = [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two", "stop": ["END"]}]
    path = write_jsonl(tmp_path / "P.jsonl", rows)
    flags = ["--samples", "1", "--short-max-tokens", "10240", "--long-max-tokens", "16384"]
    params = ["--param", 'stop=["\\n\\n"]', "--param", "top_k=20", "--temperature", "0.7"]
    cli("enqueue", str(path), "--run", "by-cli", *flags, *params, env={"TOKENMILL_REDIS_URL": redis_url})

    # When the same rows are enqueued through the API with params (the issue's example shape)
    r = tm.enqueue(
        rows,
        run="api",
        partition="P",
        samples=1,
        params={"stop": ["\n\n"], "top_k": 20, "temperature": 2.0},
        temperature=0.7,  # wins over params, as --temperature over --param
        short_max_tokens=10240,
        long_max_tokens=16384,
    )

    # Then they are the CLI's jobs, each request with the run's options and a row's own over them
    assert (r.new, r.existing) == (2, 0)
    assert all_job_ids(rclient, "api") == all_job_ids(rclient, "by-cli")
    finish_jobs(rclient, "api", mean_output_tokens=10)
    sent = {row["id"]: row for row in tm.results("api", include_truncated=True)}
    assert sorted(sent) == ["a", "b"] and all(row["sample"] == 0 for row in sent.values())
    requests = {job: job_request(rclient, "api", job) for job in all_job_ids(rclient, "api")}
    stops = sorted(str(req["stop"]) for req in requests.values())
    assert stops == [str(["END"]), str(["\n\n"])], requests
    assert {(req["top_k"], req["temperature"]) for req in requests.values()} == {(20, 0.7)}


def test_status_is_the_status_json_document(tm: Client, redis_url: str) -> None:
    tm.enqueue(ROWS, run="r")
    st = tm.status("r")
    env = {"TOKENMILL_REDIS_URL": redis_url, "TOKENMILL_SERVER_URL": "http://127.0.0.1:9"}  # as tm's
    printed = orjson.loads(cli("status", "--run", "r", "--json", env=env).stdout)
    mine = st.to_dict()
    mine.pop("at"), printed.pop("at")
    assert isinstance(st, Status) and mine == printed
    assert st.totals["queued"] == 3 and st.partitions["default"]["queued"] == 3 and not st.finished


def test_an_unknown_run_and_an_unreachable_redis_are_errors_naming_them(tm: Client) -> None:
    with pytest.raises(ConfigError, match="'nope': no run of that name"):
        tm.status("nope")
    with pytest.raises(ConfigError, match="'nope'"):
        list(tm.results("nope"))
    with pytest.raises(RedisUnavailableError, match=r"127\.0\.0\.1:9"):
        Client(redis_url="redis://127.0.0.1:9/0")
    with pytest.raises(ConfigError, match="unknown setting 'lease_ttl'"):
        Client(lease_ttl=3)


def test_wait_returns_the_final_status_and_gives_up_after_its_timeout(
    tm: Client, rclient: redis.Redis
) -> None:
    tm.enqueue(ROWS, run="r")
    with pytest.raises(WaitTimeoutError) as late:
        tm.wait("r", progress=False, timeout=0.3, interval=0.05)
    assert isinstance(late.value, TimeoutError) and late.value.status.totals["queued"] == 3
    finish_jobs(rclient, "r", mean_output_tokens=10)
    final = tm.wait("r", timeout=5)
    assert final.finished and final.totals["done"] == 3


def test_wait_draws_a_progress_bar_on_a_terminal_and_nothing_in_a_log(
    tm: Client, redis_url: str, rclient: redis.Redis
) -> None:
    tm.enqueue(ROWS, run="r")
    finish_jobs(rclient, "r", mean_output_tokens=10)
    probe = f"import tokenmill; tokenmill.Client(redis_url={redis_url!r}).wait('r')"
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    env.pop("TOKENMILL_REDIS_URL", None)
    # on a terminal (a pseudo-terminal: what a shell gives the process)
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-c", probe], env)
    shown = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child exited and closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, shown
    assert b"run r" in shown and b"3/3" in shown and b"0 failed" in shown, shown
    # in a log (a pipe): no bar
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=ROOT, env=env, timeout=60)
    assert res.returncode == 0 and res.stderr == b"" and res.stdout == b"", res


def test_results_are_the_exports_rows_from_redis_and_sealed_shards_in_its_order(
    tm: Client, tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    # Given a run of two partitions whose jobs are partly sealed into shards, partly done in Redis
    rows = [{"prompt": f"question {i}", "i": i} for i in range(30)]
    tm.enqueue(rows[:20], run="r", partition="A", short_max_tokens=12)
    tm.enqueue(rows[20:], run="r", partition="B", short_max_tokens=12)
    ids = all_job_ids(rclient, "r")
    finish_jobs(rclient, "r", ids[:25], mean_output_tokens=10)
    env = {"TOKENMILL_REDIS_URL": redis_url, "TOKENMILL_RESULTS_URL": str(tmp_path / "store")}
    cli("seal", "--once", "--all", env=env)
    finish_jobs(rclient, "r", ids[25:], mean_output_tokens=10)
    assert tm.status("r").results["sealed"], "nothing was sealed"

    # When the rows are read through the API and exported by the CLI
    got = list(tm.results("r", include_truncated=True))
    cli("export", "--run", "r", "--out", str(tmp_path / "out"), "--include-truncated", env=env)
    exported = read_export(tmp_path / "out")

    # Then they are the same rows in the same order; without truncated ones, as the export's default
    assert got == exported["A"] + exported["B"] and len(got) == 30
    assert list(tm.results("r", partition="B", include_truncated=True)) == exported["B"]
    truncated = sum(r["finish_reason"] == "length" for r in got)
    assert len(list(tm.results("r"))) == 30 - truncated
    # and as a DataFrame and a Dataset
    df = tm.to_pandas("r", include_truncated=True)
    assert df.to_dict("records") == [{**dict.fromkeys(df.columns), **r} for r in got]
    ds = tm.to_dataset("r", include_truncated=True)
    assert len(ds) == 30 and [without_nulls(r) for r in ds] == got


def test_results_and_frames_warn_how_many_truncated_rows_they_left_out(
    tm: Client, rclient: redis.Redis
) -> None:
    # Given a run whose short max_tokens cut some outputs (finish_reason "length") and a run that
    # has none cut
    rows = [{"prompt": f"question {i}", "max_tokens": 3 if i % 2 else 400} for i in range(10)]
    tm.enqueue(rows, run="cut")
    tm.enqueue([{"prompt": "whole", "max_tokens": 400}], run="whole")
    finish_jobs(rclient, "cut", mean_output_tokens=10)
    finish_jobs(rclient, "whole", mean_output_tokens=10)
    every = list(tm.results("cut", include_truncated=True))
    cut = sum(r["finish_reason"] == "length" for r in every)
    assert 0 < cut < len(every) == 10

    # When the rows are read without include_truncated, as rows, a DataFrame and a Dataset
    # Then each says how many rows it left out and how to include them, from the caller's line
    said = rf"run cut: {cut} truncated row\(s\) \(finish_reason 'length'.*include_truncated=True"
    with pytest.warns(UserWarning, match=said) as seen:
        assert len(list(tm.results("cut"))) == 10 - cut
    with pytest.warns(UserWarning, match=said) as framed:
        assert len(tm.to_pandas("cut")) == 10 - cut
    with pytest.warns(UserWarning, match=said) as built:
        assert len(tm.to_dataset("cut")) == 10 - cut
    assert [w.filename for w in (*seen, *framed, *built)] == [__file__] * 3
    # and nothing is said when nothing was left out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(tm.results("cut", include_truncated=True))) == 10
        assert len(tm.to_pandas("cut", include_truncated=True)) == 10
        assert len(tm.to_pandas("whole")) == 1


def test_to_dataset_without_the_datasets_package_names_the_extra(tm: Client, redis_url: str) -> None:
    tm.enqueue(ROWS, run="r")
    probe = (
        "import sys; sys.modules['datasets'] = None\n"  # as if it were not installed
        "import tokenmill\n"
        f"try:\n    tokenmill.Client(redis_url={redis_url!r}).to_dataset('r')\n"
        "except tokenmill.MissingExtraError as exc:\n    print(isinstance(exc, ImportError), exc)\n"
    )
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert (
        res.stdout.strip()
        == "True to_dataset() needs the datasets package: pip install 'tokenmill[datasets]'"
    )
    assert issubclass(MissingExtraError, ImportError)


def test_quality_stop_pause_and_resume_as_the_cli(tm: Client, rclient: redis.Redis) -> None:
    with pytest.raises(ConfigError, match="quality rule 'nope>1': unknown signal 'nope'"):
        tm.enqueue(ROWS, run="bad", quality_stop=["length_share>0.5", "nope>1"])
    assert rclient.keys("*") == []  # nothing enqueued
    tm.enqueue(ROWS, run="r", quality_stop="repetition>0.05@200")
    assert rclient.hgetall("tm:r:qrules") == {b"repetition>0.05@200": b"> 0.05 200 repetition"}
    assert tm.pause("r", reason="a look at the outputs") is True and tm.pause("r") is False
    paused = tm.wait("r", progress=False, timeout=10).paused  # paused, nothing running: it returns
    assert paused is not None and (paused["reason"], paused["by"]) == ("a look at the outputs", "person")
    resumed = tm.resume("r")
    assert resumed.unpaused == "a look at the outputs" and resumed.republished == 3
    assert tm.status("r").paused is None
    with pytest.raises(ConfigError, match="--run 'nope'"):
        tm.pause("nope")


def test_runs_cancel_and_retry_as_the_cli(tm: Client) -> None:
    tm.enqueue(ROWS, run="r")
    (info,) = tm.runs()
    assert isinstance(info, RunInfo) and info.run == "r" and info.totals["queued"] == 3
    cancelled = tm.cancel("r")
    assert isinstance(cancelled, CancelSummary) and cancelled.cancelled == 3
    assert tm.status("r").totals["cancelled"] == 3
    back = tm.retry("r", cancelled=True)
    assert isinstance(back, RetrySummary) and back.total == 3 and "3 cancelled jobs back" in back.line()
    assert tm.retry("r").total == 0  # nothing failed
    with pytest.raises(ConfigError, match="'nope' is not a failure class"):
        tm.retry("r", classes=["nope"])
