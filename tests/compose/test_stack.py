"""compose.yaml built and run: the deployment users copy, checked against running containers.

`make test-compose` runs these (they are slow: images are built and the stack is started, so
plain `make test` leaves them out). The stack is compose.yaml with the server manager on the sim
engine (docker/compose.sim.yaml) and Redis from Debian's redis-server
(docker/compose.redis-debian.yaml). The tests run in file order on one stack: the last one takes
it down and up again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_mgr.sim.textgen import expected_completion
from tests.chaos import mid_stream, row_messages
from tests.compose.stack import (
    DEMO,
    PRODUCER_UID,
    SERVICES,
    SIM_MEAN_OUTPUT_TOKENS,
    Stack,
    docker,
    published_ports,
    read_jsonl,
    watch_workers,
)
from tests.pipeline import expected_for, read_export
from tests.procs import wait_for
from tokenmill import keys

DEMO_JOBS = 200  # B1.jsonl (120 rows) and B2.jsonl (80)
SHORT_MAX_TOKENS = 10240  # the producer's default; the sim's outputs stop long before it

pytestmark = pytest.mark.timeout(1800)


def enqueue_demo(stack: Stack, run: str, partitions: list[str]) -> int:
    """The demo dataset, once per partition name (same prompts, new job ids); returns the jobs."""
    for p in partitions:
        for f in ("B1", "B2"):
            stack.producer(
                "tokenmill", "enqueue", f"/data/input/{f}.jsonl", "--run", run, "--partition", f"{p}{f}"
            )
    return DEMO_JOBS * len(partitions)


def export_problems(stack: Stack, run: str, sources: dict[str, Path]) -> list[str]:
    """Export ``run`` through the producer and compare it with what the sim generates for each
    source row: every row once, in order, byte for byte (an empty list: the export is exact)."""
    stack.producer("tokenmill", "export", "--run", run, "--out", f"/data/prepared/{run}")
    out = stack.exported() / run
    got = read_export(out)
    problems = [f"partitions {sorted(got)}, want {sorted(sources)}"] if set(got) != set(sources) else []
    for partition, src in sources.items():
        want_rows = read_jsonl(src)
        rows = got.get(partition, [])
        ids, want_ids = [r["id"] for r in rows], [str(r["id"]) for r in want_rows]
        if ids != want_ids:
            lost, dup = set(want_ids) - set(ids), len(ids) - len(set(ids))
            problems.append(
                f"{partition}: {len(ids)} rows for {len(want_ids)}; lost {sorted(lost)}, {dup} duplicated"
            )
        for row, src_row in zip(rows, want_rows, strict=False):
            problems += _row_problems(partition, row, src_row)
    for path in out.glob("*.jsonl"):
        if path.stat().st_uid != PRODUCER_UID:
            problems.append(f"{path} is owned by uid {path.stat().st_uid}, not the producer's {PRODUCER_UID}")
    return problems


def _row_problems(partition: str, row: dict[str, Any], src_row: dict[str, Any]) -> list[str]:
    if row["messages"][:-1] != row_messages(src_row):
        return [f"{partition}/{row['id']}: its input messages are not its source row's"]
    want = expected_for(
        row, max_tokens=SHORT_MAX_TOKENS, reasoning=True, mean_output_tokens=SIM_MEAN_OUTPUT_TOKENS
    )
    said = row["messages"][-1]
    got = (
        said["content"],
        said.get("reasoning_content"),
        row["finish_reason"],
        row["usage"]["completion_tokens"],
    )
    if got != (want.content, want.reasoning_content, want.finish_reason, want.completion_tokens):
        return [f"{partition}/{row['id']}: {len(said['content'])} chars, want {len(want.content)}"]
    return []


@pytest.fixture(scope="module")
def demo_run(stack: Stack) -> dict[str, Any]:
    """The demo dataset enqueued by the producer profile as run ``demo`` (its default command
    takes B1.jsonl, as .env's INPUT_FILE and RUN say), and finished."""
    stack.producer()
    stack.producer("tokenmill", "enqueue", "/data/input/B2.jsonl", "--run", "demo")
    return stack.wait_finished("demo", DEMO_JOBS, timeout=900)


def test_every_published_port_is_bound_to_the_hosts_loopback_only(stack: Stack) -> None:
    published: dict[str, list[str]] = {}
    for service in SERVICES:
        for container in stack.containers(service):
            published.setdefault(service, []).extend(published_ports(container))
    for service, lines in published.items():
        for line in lines:
            assert line.split(" -> ")[1].startswith("127.0.0.1:"), f"{service} publishes {line!r}"
    want = {
        "redis": "REDIS_PORT",
        "server": "SERVER_PORT",
        "flower": "FLOWER_PORT",
        "metrics": "METRICS_PORT",
        "api": "API_PORT",
    }
    for service, port in want.items():
        assert published.get(service) and all(
            line.endswith(f"127.0.0.1:{stack.port(port)}") for line in published[service]
        ), f"{service}: {published.get(service)}"
    assert set(published) - set(want) <= {s for s, lines in published.items() if not lines}


def test_no_service_runs_as_root(stack: Stack) -> None:
    for service in SERVICES:
        for container in stack.containers(service):
            uid = docker("exec", container, "id", "-u").stdout.strip()
            assert uid != "0", f"{service} ({container}) runs as root"


def test_the_producer_profile_enqueues_the_demo_dataset_every_job_ends_done_and_the_export_is_exact(
    stack: Stack, demo_run: dict[str, Any]
) -> None:
    assert demo_run["done"] == DEMO_JOBS and demo_run["failed"] == 0, demo_run
    sources = {"B1": DEMO / "B1.jsonl", "B2": DEMO / "B2.jsonl"}
    assert export_problems(stack, "demo", sources) == []


def test_flower_answers_behind_basic_auth_and_refuses_without(stack: Stack) -> None:
    user, password = stack.settings["FLOWER_BASIC_AUTH"].split(":", 1)
    assert stack.http("FLOWER_PORT", "/")[0] == 401
    assert stack.http("FLOWER_PORT", "/api/tasks", auth=(user, password + "x"))[0] == 401
    status, body = stack.http("FLOWER_PORT", "/", auth=(user, password))
    assert status == 200 and b"Flower" in body
    status, body = stack.http("FLOWER_PORT", "/api/tasks?limit=1", auth=(user, password))
    assert status == 200 and isinstance(orjson.loads(body), dict)


def test_the_metrics_endpoint_serves_the_ledger(stack: Stack, demo_run: dict[str, Any]) -> None:
    status, body = stack.http("METRICS_PORT", "/metrics")
    assert status == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("tokenmill_redis_up", ())] == 1
    done = sum(
        v
        for (name, labels), v in samples.items()
        if name == "tokenmill_jobs" and ("run", "demo") in labels and ("state", "done") in labels
    )
    assert done == DEMO_JOBS
    assert any(name == "tokenmill_server_state" and ("state", "ready") in labels and v == 1
               for (name, labels), v in samples.items())  # fmt: skip


def test_the_sealer_writes_shards_into_its_volume(stack: Stack, demo_run: dict[str, Any]) -> None:
    def sealed() -> dict[str, Any] | None:
        results: dict[str, Any] = stack.status("demo")["results"]
        return results if sum(results["sealed"].values()) == DEMO_JOBS else None

    results = wait_for(sealed, 180, "the sealer to seal every demo result", every=1)
    assert results["store"] == "/data/results"
    k = keys.RunKeys("demo")
    with stack.client() as client:
        shards = {p: {s.decode() for s in client.smembers(k.shards(p))} for p in ("B1", "B2")}
    want = {f"/data/results/demo/{p}/{s}.parquet" for p, ids in shards.items() for s in ids}
    assert all(shards.values()) and len(want) == results["shards"]
    listed = stack.run("exec", "-T", "sealer", "find", "/data/results/demo", "-name", "*.parquet").stdout
    assert want <= set(listed.split()), listed
    # the volume is the producer's too: it reads them back
    listed = stack.producer("find", "/data/results/demo", "-name", "*.parquet").stdout
    assert want <= set(listed.split()), listed


def test_a_batch_sent_through_the_apis_published_port_completes_one_output_line_per_request(
    stack: Stack,
) -> None:
    # Given eight rows of the demo dataset as a Batch input file, and the openai SDK on the host
    # pointed at the API's published port with the second of .env's keys
    rows = read_jsonl(DEMO / "B1.jsonl")[:8]
    lines = [
        {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-4o-mini", "messages": row_messages(row)}}
        for i, row in enumerate(rows)
    ]  # fmt: skip
    url = f"http://127.0.0.1:{stack.port('API_PORT')}/v1"
    client = openai.OpenAI(base_url=url, api_key=stack.settings["API_KEYS"].split(",")[1], max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # a key not in API_KEYS
        openai.OpenAI(base_url=url, api_key="not-a-key", max_retries=0).files.list()

    # When it is uploaded and run as a batch
    f = client.files.create(file=("compose.jsonl", b"".join(orjson.dumps(x) + b"\n" for x in lines)),
                            purpose="batch")  # fmt: skip
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    ended = ("completed", "failed", "expired", "cancelled")
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status in ended and b,
        600,
        "the batch to end",
        every=1,
    )

    # Then it completed, with one output line per custom_id, each the sim's exact answer
    assert done.status == "completed" and done.error_file_id is None, (done, stack.logs())
    out = [orjson.loads(x) for x in client.files.content(done.output_file_id or "").read().splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(x["custom_id"] for x in lines)
    for o in out:
        said = o["response"]["body"]["choices"][0]["message"]
        want = expected_completion(
            lines[int(o["custom_id"][2:])]["body"]["messages"],
            max_tokens=SHORT_MAX_TOKENS,
            reasoning=True,
            mean_output_tokens=SIM_MEAN_OUTPUT_TOKENS,
        )
        assert (said["content"], said.get("reasoning_content")) == (want.content, want.reasoning_content)


def test_scaled_short_workers_take_jobs(stack: Stack) -> None:
    before = set(stack.containers("worker-short"))
    stack.up("--scale", "worker-short=3", "--no-recreate")
    new = set(stack.containers("worker-short")) - before
    assert len(new) == 2, f"worker-short before {before}, after scaling {new}"
    hostnames = {stack.hostname(c) for c in new}
    jobs = enqueue_demo(stack, "scale", ["s1", "s2", "s3"])
    with stack.client() as client:
        seen = watch_workers(client, "scale", hostnames, timeout=300)
    assert hostnames <= seen, f"the new workers {hostnames} held no job of the run; seen: {seen}"
    totals = stack.wait_finished("scale", jobs, timeout=900)
    assert totals["failed"] == 0, totals


def test_a_killed_worker_and_a_restarted_redis_lose_and_duplicate_nothing(stack: Stack) -> None:
    run, partitions = "chaos", ["c1", "c2", "c3", "c4"]
    jobs = enqueue_demo(stack, run, partitions)
    by_host = {stack.hostname(c): c for c in stack.containers("worker-short")}
    with stack.client() as client:

        def victim() -> str | None:
            holders = {v.worker.rsplit(":", 1)[0] for v in mid_stream(client, run).values()}
            return next((h for h in holders if h in by_host), None)

        host = wait_for(victim, 300, "a short worker holding a job mid-stream", every=0.1)
        docker("kill", by_host[host])
        # what it held when it died (a job it committed between the look and the kill stays done)
        hit = [j for j, v in mid_stream(client, run).items() if v.worker.rsplit(":", 1)[0] == host]
        assert hit, "the worker finished its jobs before it was killed"
        # Redis restarts while the run still goes on
        t = stack.status(run)["totals"]
        assert t["done"] + t["failed"] < jobs, "the run ended before Redis was restarted: make it longer"
    stack.run("restart", "redis", timeout=300)
    totals = stack.wait_finished(run, jobs, timeout=900)
    assert totals["failed"] == 0, totals  # 0 lost
    # the killed worker's jobs were reaped and continued from their checkpoints (the sealer has
    # since stripped the jobs' own records: the run's counters say it)
    stats = stack.status(run)["stats"]
    assert stats.get("continued_jobs", 0) >= len(hit), (stats, hit)
    sources = {f"{p}{f}": DEMO / f"{f}.jsonl" for p in partitions for f in ("B1", "B2")}
    assert export_problems(stack, run, sources) == []  # 0 duplicated, every text exact


def test_the_server_manager_gets_compose_s_sigterm_and_drains(stack: Stack) -> None:
    (container,) = stack.containers("server")
    started = time.monotonic()
    stack.run("stop", "--timeout", "90", "server", timeout=300)
    took = time.monotonic() - started
    code = docker("inspect", "-f", "{{.State.ExitCode}}", container).stdout.strip()
    logs = docker("logs", container).stderr + docker("logs", container).stdout
    assert code == "0" and took < 90, f"exit {code} after {took:.0f}s (137: SIGKILLed after the timeout)"
    assert "SIGTERM: draining and stopping every server" in logs, logs[-3000:]
    stack.up()


def test_down_then_up_keeps_the_run(stack: Stack, demo_run: dict[str, Any]) -> None:
    first = read_export(stack.exported() / "demo")
    stack.down()
    assert stack.all_containers() == []
    stack.up()
    doc = orjson.loads(stack.producer("tokenmill", "status", "--run", "demo", "--json").stdout)
    assert doc["totals"]["done"] == DEMO_JOBS and doc["totals"]["total"] == DEMO_JOBS, doc["totals"]
    # the results came back from the AOF and the results volume
    stack.producer("tokenmill", "export", "--run", "demo", "--out", "/data/prepared/demo-after")
    assert read_export(stack.exported() / "demo-after") == first
