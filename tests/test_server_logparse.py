"""Reading SGLang logs: live figures by field name, crash classes, and the restart policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_mgr.config import ServerConfig
from server_mgr.crash import GIVE_UP, LOWER_FRACTION, RAISE_FRACTION, RESTART, Crash, classify
from server_mgr.logparse import LiveFigures, LogTail, capacity_line, launch_fraction, parse_batch_line
from server_mgr.policy import FAIL, RELAUNCH, RestartPolicy
from server_mgr.process import gpu_holders
from tokenmill.server_report import CAPACITY_METRIC, METRIC_NAMES, parse_metrics


def test_prefill_line_of_0_5_23_is_read_by_field_name() -> None:
    line = (
        "[2026-04-05 20:02:51 TP0] Prefill batch, #new-seq: 1, #new-token: 158, #cached-token: 0, "
        "token usage: 0.08, #running-req: 31, #queue-req: 2, #pending-token: 0, cuda graph: True, "
        "input throughput (token/s): 559.53"
    )
    kind, figures = parse_batch_line(line)
    assert kind == "prefill"
    assert figures == {
        "new_seq": 1,
        "new_token": 158,
        "cached_token": 0,
        "token_usage": 0.08,
        "running_req": 31,
        "queue_req": 2,
        "pending_token": 0,
        "graph": 1.0,
        "input_throughput": 559.53,
    }


def test_the_cpu_servers_lines_read_the_same_with_cpu_graph_for_cuda_graph() -> None:
    # SGLang 0.5.23 on the CPU (seen)
    prefill = (
        "[2026-11-30 12:42:20] Prefill batch, #new-seq: 1, #new-token: 12, #cached-token: 0, "
        "token usage: 0.00, #running-req: 0, #queue-req: 0, #pending-token: 0, cpu graph: False, "
        "input throughput (token/s): 11.17"
    )
    decode = (
        "[2026-11-30 13:24:20] Decode batch, #running-req: 25, #token: 13100, token usage: 0.66, "
        "cpu graph: False, gen throughput (token/s): 338.02, #queue-req: 0"
    )
    assert parse_batch_line(prefill)[1]["graph"] == 0.0
    assert parse_batch_line(decode) == (
        "decode",
        {"running_req": 25, "num_used_tokens": 13100, "token_usage": 0.66, "graph": 0.0,
         "gen_throughput": 338.02, "queue_req": 0},
    )  # fmt: skip


def test_fields_in_another_order_and_trailing_separators_are_read_too() -> None:
    production = (
        "[2026-02-24 12:20:19 TP0] Prefill batch, #new-seq: 1, #new-token: 1, "
        "#cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0, "
        "input throughput (token/s): 0.29, cuda graph: False"
    )
    assert parse_batch_line(production)[1]["input_throughput"] == 0.29
    old = (
        "[2025-11-06 10:00:00] Decode batch, #running-req: 5, #token: 20800, token usage: 0.29, "
        "#queue-req: 0, "
    )
    assert parse_batch_line(old)[1] == {
        "running_req": 5,
        "num_used_tokens": 20800,
        "token_usage": 0.29,
        "queue_req": 0,
    }


def test_decode_lines_and_retractions_accumulate_into_live_figures() -> None:
    live = LiveFigures()
    live.feed(
        "[t] Decode batch, #running-req: 5, #token: 20800, token usage: 0.29, cuda graph: True, "
        "gen throughput (token/s): 144.95, #queue-req: 3"
    )
    live.feed(
        "[t] KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_tokens_gained: 9, "
        "#new_token_ratio: 0.4000 -> 0.6000"
    )
    live.feed("[t] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_token_ratio: 0.4 -> 0.6")
    live.feed('[t] INFO:     127.0.0.1:40052 - "POST /v1/chat/completions HTTP/1.1" 200 OK')
    assert live.figures["gen_throughput"] == 144.95 and live.figures["queue_req"] == 3
    assert live.figures["retractions"] == 5 and live.decode_lines == 1


def test_metrics_figures_never_take_the_retraction_count_back() -> None:
    # Given 5 retractions counted from the log
    live = LiveFigures()
    live.feed("[t] KV cache pool is full. Retract requests. #retracted_reqs: 5, #new_token_ratio: 0.4 -> 0.6")
    # When /metrics answers with an older count (its counter lags or is not there yet)
    live.merge_metrics({"retractions": 0.0, "running_req": 2.0})
    # Then the count stays, and the other figures are taken
    assert live.figures["retractions"] == 5 and live.figures["running_req"] == 2
    # And a count /metrics saw first is taken too
    live.merge_metrics({"retractions": 7.0})
    assert live.figures["retractions"] == 7 and live.retractions == 7


def test_capacity_and_fraction_come_from_the_startup_lines() -> None:
    line = (
        "[t TP0] max_total_num_tokens=2243474, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=4096, context_len=131072, available_gpu_mem=38.05 GB"
    )
    assert capacity_line(line) == (2243474, 131072)
    assert launch_fraction("server_args=ServerArgs(model_path='m', mem_fraction_static=0.88, x=1)") == 0.88


def test_log_tail_returns_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "s.log"
    path.write_bytes(b"old line\n")
    tail = LogTail(path, offset=path.stat().st_size)
    with path.open("ab") as fh:
        fh.write(b"one\rtwo\nthr")
    assert tail.read_lines() == ["one", "two"]
    with path.open("ab") as fh:
        fh.write(b"ee\n")
    assert tail.read_lines() == ["three"]


def test_metrics_page_gives_the_same_names_summed_over_dp_ranks() -> None:
    page = (
        "\n".join(
            [
                "# TYPE sglang:num_running_reqs gauge",
                'sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="0"} 3.0',
                'sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="1"} 4.0',
                'sglang:num_running_reqs{model_name="m",tp_rank="1",dp_rank="0"} 3.0',
                "# TYPE sglang:token_usage gauge",
                'sglang:token_usage{model_name="m",tp_rank="0",dp_rank="0"} 0.2',
                'sglang:token_usage{model_name="m",tp_rank="0",dp_rank="1"} 0.4',
                "# TYPE sglang:num_queue_reqs gauge",
                'sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1.0',
            ]
        )
        + "\n"
    )
    assert parse_metrics(page) == pytest.approx({"running_req": 7.0, "token_usage": 0.3, "queue_req": 1.0})


def test_the_routers_engine_metrics_sum_its_workers_into_one_load() -> None:
    # sglang-router 0.3.2's /engine_metrics: every worker's /metrics, labelled with its address,
    # sglang:<name> renamed sglang_<name> (seen in front of SGLang 0.5.23)
    def sample(name: str, worker: str, value: float) -> str:
        return f'sglang_{name}{{engine_type="unified",tp_rank="0",worker_addr="{worker}"}} {value}'

    lines = []
    for name, values in {
        "num_running_reqs": (3, 5),
        "num_queue_reqs": (1, 0),
        "num_used_tokens": (100, 200),
        "max_total_num_tokens": (20000, 20000),
        "token_usage": (0.1, 0.3),
    }.items():
        lines += [f"# TYPE sglang_{name} gauge"] + [
            sample(name, w, v) for w, v in zip(("http://a:1", "http://b:2"), values, strict=True)
        ]
    figures = parse_metrics("\n".join(lines) + "\n", extra=(CAPACITY_METRIC,))
    assert figures == pytest.approx(
        {"running_req": 8, "queue_req": 1, "num_used_tokens": 300, CAPACITY_METRIC: 40000, "token_usage": 0.2}
    )


def test_a_page_of_many_families_gives_the_figures_the_whole_page_parsed_gives() -> None:
    # SGLang's /metrics is ~600 lines, mostly histograms; only a few gauges and one counter are
    # read. Families whose names extend a read one, labels holding spaces and braces, a counter
    # typed under its family name, and comments must not change a figure.
    lines = [
        "# HELP sglang:num_running_reqs The number of running requests.",
        "# TYPE sglang:num_running_reqs gauge",
        'sglang:num_running_reqs{model_name="a {b} c",tp_rank="0"} 5.0',
        'sglang:num_running_reqs{model_name="a {b} c",tp_rank="1"} 5.0',
        "# TYPE sglang:num_running_reqs_histogram histogram",
        *(f'sglang:num_running_reqs_histogram_bucket{{le="{b}",tp_rank="0"}} {b}' for b in (1, 2, 4, "+Inf")),
        "sglang:num_running_reqs_histogram_count 9",
        "# TYPE sglang:num_retracted_requests counter",
        'sglang:num_retracted_requests_total{model_name="m",tp_rank="0"} 3.0',
        'sglang:num_retracted_requests_created{model_name="m",tp_rank="0"} 1.7e9',
        "# TYPE sglang:token_usage gauge",
        "sglang:token_usage 0.25 1700000000000",
        "# TYPE sglang:e2e_request_latency_seconds histogram",
        *(f'sglang:e2e_request_latency_seconds_bucket{{le="{b}"}} 1' for b in range(300)),
        f"{CAPACITY_METRIC} 20000",
    ]
    page = "\n".join(lines) + "\n"
    figures = parse_metrics(page, extra=(CAPACITY_METRIC,))
    assert figures == pytest.approx(
        {"running_req": 5.0, "retractions": 3.0, "token_usage": 0.25, CAPACITY_METRIC: 20000}
    )
    whole: dict[str, float] = {}  # the library over the whole page, as parse_metrics read it before
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            name = sample.name if sample.name == CAPACITY_METRIC else METRIC_NAMES.get(sample.name)
            if name is not None and sample.labels.get("tp_rank", "0") == "0":
                whole[name] = whole.get(name, 0.0) + sample.value
    assert figures == pytest.approx(whole)


# --- crash classes (contract §5.4, §6.4) ---------------------------------------------------------

GRAPH_OOM = """[2026-11-29 10:00:00] server_args=ServerArgs(model_path='m', mem_fraction_static=0.9)
[2026-11-29 10:00:01] Scheduler hit an exception: Traceback (most recent call last):
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.
Exception: Capture cuda graph failed: CUDA out of memory. Tried to allocate 2.00 GiB.
Possible solutions:
1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)
[2026-11-29 10:00:01] Rank 0 scheduler died during initialization (exit code: -9). If exit code is -9 \
(SIGKILL), a common cause is the OS OOM killer.
[2026-11-29 10:00:01] Received sigquit from a child process. It usually means the child failed.
"""
TOO_LOW = """[2026-11-29 10:00:01 TP0] Scheduler hit an exception: Traceback (most recent call last):
RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: 0.5
[2026-11-29 10:00:01] Rank 0 scheduler died during initialization (exit code: -9).
"""
# SGLang 0.5.23 on the CPU with --mem-fraction-static 0.0001 (seen):
NO_ROOM = """[2026-11-30 13:30:16] Scheduler hit an exception: Traceback (most recent call last):
ValueError: Loaded weights leave no GPU memory for the KV cache under --mem-fraction-static=0.0001. \
Raise --mem-fraction-static above 0.002 (minimum viable = 1 - available/pre = 0.0017). If using \
speculative decoding, draft weights are now counted.
[2026-11-30 13:30:16] Received sigquit from a child process. It usually means the child failed.
"""
RUNTIME = """[2026-11-29 10:00:01] Decode batch, #running-req: 5, #token: 20800, #queue-req: 0
[2026-11-29 10:00:02 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "scheduler.py", line 1104, in event_loop_overlap
RuntimeError: CUDA error: an illegal memory access was encountered
"""


@pytest.mark.parametrize(
    ("log", "code", "first", "kind", "remedy"),
    [
        (GRAPH_OOM, -9, True, "oom_fraction_too_high", LOWER_FRACTION),
        (TOO_LOW, -9, True, "oom_fraction_too_low", RAISE_FRACTION),
        (NO_ROOM, -9, True, "oom_fraction_too_low", RAISE_FRACTION),
        (RUNTIME, -9, False, "scheduler_exception", RESTART),
        ("[t] Prefill out of memory. Try to lower your batch size.\n", -9, True, "cuda_oom", LOWER_FRACTION),
        ("[t] Prefill out of memory. Try to lower your batch size.\n", -9, False, "cuda_oom", RESTART),
        ("[t] Uvicorn running\n", -9, False, "killed", RESTART),
        (
            "[t] ERROR: [Errno 98] error while attempting to bind on address: address already in use\n",
            1,
            True,
            "port_in_use",
            RESTART,
        ),
        (
            "sglang serve: error: argument --kv-cache-dtype: invalid choice: 'x'\n",
            2,
            True,
            "invalid_arguments",
            GIVE_UP,
        ),
        (
            "[t] Scheduler watchdog timeout (self.watchdog_timeout=300, self.soft=False)\n",
            -9,
            False,
            "watchdog_timeout",
            RESTART,
        ),
        (
            "ValueError: Not enough host memory available. Requesting 48 GB but only have 20 GB free.\n",
            1,
            True,
            "hicache_host_memory",
            GIVE_UP,
        ),
        ("boom\n", 3, True, "exited", RESTART),
    ],
)
def test_a_death_is_classified_by_its_log_not_by_exit_137(
    log: str, code: int, first: bool, kind: str, remedy: str
) -> None:
    crash = classify(log, code, first_prefill=first)
    assert (crash.kind, crash.remedy) == (kind, remedy), crash


def test_the_crash_detail_names_the_exception_line() -> None:
    crash = classify(RUNTIME, -9, first_prefill=False)
    assert crash.describe() == (
        "scheduler_exception: a scheduler raised: RuntimeError: CUDA error: "
        "an illegal memory access was encountered (exit -9)"
    )
    assert "exit 137 alone does not say which" in classify("", 137, first_prefill=False).describe()


# --- the restart policy ---------------------------------------------------------------------------


def _policy(**keys: object) -> RestartPolicy:
    return RestartPolicy(ServerConfig(name="s", port=1, engine="sim", **keys))  # type: ignore[arg-type]


def test_backoff_doubles_and_a_crash_loop_fails_with_the_reason() -> None:
    policy = _policy(max_restarts=3, restart_window_s=60.0, backoff_initial_s=1.0, backoff_max_s=3.0)
    crash = Crash("killed", "gone", RESTART, -9)
    delays = [policy.decide(crash, 100.0 + i, None).delay_s for i in range(3)]
    assert delays == [1.0, 2.0, 3.0]
    verdict = policy.decide(crash, 103.0, None)
    assert verdict.action == FAIL and verdict.reason.startswith("crash loop: 4 crashes within 60 s")


def test_crashes_outside_the_window_are_forgotten() -> None:
    policy = _policy(max_restarts=1, restart_window_s=10.0)
    crash = Crash("killed", "gone", RESTART, -9)
    assert policy.decide(crash, 0.0, None).action == RELAUNCH
    assert policy.decide(crash, 20.0, None).action == RELAUNCH
    assert policy.decide(crash, 21.0, None).action == FAIL


def test_startup_oom_steps_the_fraction_within_bounds() -> None:
    policy = _policy(mem_fraction_bounds=(0.8, 0.9), mem_fraction_step=0.05)
    high = Crash("oom_fraction_too_high", "x", LOWER_FRACTION, -9)
    assert policy.decide(high, 0.0, 0.9).fraction == 0.85
    assert policy.decide(high, 0.0, 0.85).fraction == 0.8
    verdict = policy.decide(high, 0.0, 0.8)
    assert verdict.action == FAIL and "would leave mem_fraction_bounds [0.8, 0.9]" in verdict.reason


def test_a_fraction_too_high_after_one_too_low_means_none_fits() -> None:
    policy = _policy(mem_fraction_bounds=(0.5, 0.95), mem_fraction_step=0.02)
    low = Crash("oom_fraction_too_low", "x", RAISE_FRACTION, -9)
    assert policy.decide(low, 0.0, 0.7).fraction == 0.72
    verdict = policy.decide(Crash("oom_fraction_too_high", "x", LOWER_FRACTION, -9), 0.0, 0.72)
    assert verdict.action == FAIL and verdict.reason.startswith("no mem_fraction_static fits")


def test_a_fraction_too_low_goes_past_the_smallest_one_the_log_names() -> None:
    crash = classify(NO_ROOM, -9, first_prefill=True)
    policy = _policy(mem_fraction_bounds=(0.0001, 0.5), mem_fraction_step=0.01)
    assert crash.min_fraction == 0.002
    assert policy.decide(crash, 0.0, 0.0001).fraction == 0.012
    assert policy.decide(classify(TOO_LOW, -9, first_prefill=True), 0.0, 0.3).fraction == 0.31


def test_a_pool_pinned_by_max_total_tokens_is_not_cured_by_a_fraction() -> None:
    policy = _policy(extra_args=("--max-total-tokens=-8",))
    verdict = policy.decide(classify(TOO_LOW, -9, first_prefill=True), 0.0, 0.8)
    assert verdict.action == FAIL and "set by --max-total-tokens -8 in extra_args" in verdict.reason


def test_an_unset_fraction_steps_from_the_bound() -> None:
    policy = _policy(mem_fraction_bounds=(0.5, 0.95), mem_fraction_step=0.05)
    assert policy.decide(Crash("o", "x", LOWER_FRACTION), 0.0, None).fraction == 0.9


def test_a_refused_argument_is_not_retried() -> None:
    verdict = _policy().decide(Crash("invalid_arguments", "bad flag", GIVE_UP, 2), 0.0, None)
    assert verdict.action == FAIL and "restarting cannot fix this" in verdict.reason


def test_gpu_holders_are_the_given_pids_nvidia_smi_lists() -> None:
    listing = "4242, sglang::scheduler_TP0, 70000 MiB\n777, python, 1000 MiB\n"
    assert gpu_holders([4242, 5], run=lambda *args: listing) == [4242]
