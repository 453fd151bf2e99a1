"""The read-only commands' Redis client (``tokenmill.quick_redis``) against a real redis-server:
each read in redis-py's shape, the same status and runs documents as on redis-py, a password,
a database and a name, clear errors naming the URL, a restart between commands, TLS; and the
read-only commands start without importing redis-py."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from producer.cancel import cancel_run
from producer.enqueue import Enqueuer, Routing
from producer.runs import list_runs
from producer.status import run_status
from tests import certs
from tests.finishing import all_job_ids, finish_jobs
from tests.pipeline import write_jsonl
from tests.procs import ROOT, RedisServer
from tokenmill import keys, quick_redis, servers
from tokenmill.errors import RedisUnavailableError
from tokenmill.ledger import Ledger
from tokenmill.local_redis import free_port
from tokenmill.quick_redis import QuickRedis
from tokenmill.redis_conn import DEADLINES
from tokenmill.settings import Settings


def quick(url: str, name: str | None = None) -> QuickRedis:
    client = QuickRedis.from_url(url, name=name)
    assert client is not None, url
    return client


def test_each_read_returns_what_redis_py_returns(redis_url: str, rclient: redis.Redis) -> None:
    rclient.set("s", "text")
    rclient.hset("h", mapping={"a": "1", "b": "two"})
    rclient.sadd("set", "x", "y")
    rclient.zadd("z", {"m": 1.0})
    rclient.rpush("l", "p", "q", "r")
    q = quick(redis_url)
    reads = [
        ("get", ("s",)),
        ("get", ("missing",)),
        ("hget", ("h", "b")),
        ("hgetall", ("h",)),
        ("hgetall", ("missing",)),
        ("hmget", ("h", ["a", "nope", "b"])),
        ("smembers", ("set",)),
        ("sismember", ("set", "x")),
        ("sismember", ("set", "w")),
        ("scard", ("set",)),
        ("zcard", ("z",)),
        ("llen", ("l",)),
    ]
    for name, args in reads:
        assert getattr(q, name)(*args) == getattr(rclient, name)(*args), name
    assert type(q.time()) is tuple and abs(q.time()[0] - rclient.time()[0]) <= 1
    pq, pr = q.pipeline(transaction=False), rclient.pipeline(transaction=False)
    for name, args in reads:
        getattr(pq, name)(*args)
        getattr(pr, name)(*args)
    assert pq.execute() == pr.execute()


def test_status_runs_and_servers_read_the_same_on_both_clients(
    tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    # Given a run with done, cancelled and queued jobs in two partitions, and a published server
    enq = Enqueuer(Ledger(rclient, "r"), Routing(model="m"), 1000)
    for part in ("A", "B"):
        rows = [{"prompt": f"{part}{i}"} for i in range(6)]
        enq.enqueue_file(write_jsonl(tmp_path / f"{part}.jsonl", rows))
    finish_jobs(rclient, "r", all_job_ids(rclient, "r")[:4], mean_output_tokens=8)
    cancel_run(rclient, "r", "B")
    servers.publish(rclient, servers.ServerRecord("s1", "http://127.0.0.1:1", servers.READY, live={"x": 1.5}))
    rclient.hset(keys.admission_used("s1"), mapping={"rule": "window", "window": "4", "slot:a": "9"})
    q = quick(redis_url)

    # Then every document reads the same through the quick client
    a, b = run_status(q, "r", ("http://127.0.0.1:1",)), run_status(rclient, "r", ("http://127.0.0.1:1",))
    a.pop("at"), b.pop("at")
    assert a == b
    assert a["totals"]["done"] == 4 and a["totals"]["cancelled"] == 6 and a["admission"]["s1"]["window"] == 4
    assert list_runs(q) == list_runs(rclient)
    assert servers.load_all(q) == servers.load_all(rclient)


def test_a_password_a_database_and_a_name_are_used_and_errors_name_the_url_without_the_password(
    tmp_path: Path,
) -> None:
    server = RedisServer(tmp_path / "guarded", password="s3cret").start()
    try:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        redis.Redis.from_url(url).set("where", "db3")
        q = quick(url, name="probe")
        assert q.get("where") == b"db3"
        assert q.send([(None, ("CLIENT", "GETNAME"))]) == [b"probe"]
        with pytest.raises(RedisUnavailableError) as wrong:
            quick(f"redis://:nope@127.0.0.1:{server.port}/0").ping()
        assert "refused the credentials" in str(wrong.value) and ":***@" in str(wrong.value)
        assert "nope" not in str(wrong.value)
        with pytest.raises(RedisUnavailableError) as missing:
            quick(f"redis://127.0.0.1:{server.port}/0").ping()
        assert "needs a password" in str(missing.value)
    finally:
        server.kill()


def test_an_unreachable_redis_is_an_error_naming_it() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnavailableError) as failed:
        quick_redis.connect(Settings(redis_url=url))
    assert f"cannot reach Redis at {url}" in str(failed.value)


def test_a_host_that_accepts_and_never_answers_is_reported_after_the_read_deadline() -> None:
    # Given a listener that takes connections and never answers (a vanished host behind a proxy)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0?socket_timeout=0.5"  # the URL's deadline
        t0 = time.monotonic()
        # When a read-only command connects and reads (on a thread, waited for 10 s at most: an
        # upper bound a few times the deadline is one a loaded machine misses)
        failed: list[BaseException] = []
        reader = threading.Thread(target=lambda: _raised(quick(url, name="probe").ping, failed), daemon=True)
        reader.start()
        reader.join(10)
        took = time.monotonic() - t0
    # Then it gives up after its deadline, worded as every other client words it
    assert failed, "the read had not given up after 10 s"
    assert isinstance(failed[0], RedisUnavailableError), failed
    assert f"cannot reach Redis at {url}" in str(failed[0]), failed[0]
    assert took > 0.4, took


def _raised(call: Callable[[], object], into: list[BaseException]) -> None:
    try:
        call()
    except BaseException as exc:
        into.append(exc)


def test_without_options_a_read_waits_as_long_as_tokenmills_redis_py_clients_and_no_longer(
    redis_url: str,
) -> None:
    # Given the read-only commands' client on a URL that sets no deadline
    client = quick(redis_url)

    # When it has connected and read
    assert client.ping()

    # Then its connection gives a reply the deadline tokenmill gives redis-py (5 s), not longer
    assert client._sock is not None
    assert client._sock.gettimeout() == DEADLINES["socket_timeout"] == 5


def test_a_redis_restarted_between_two_reads_is_read_again_on_a_new_connection(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "restarted").start()
    try:
        server.client().set("k", "v")
        q = quick(server.url)
        assert q.get("k") == b"v"
        server.restart()  # AOF on: the key is still there
        assert q.get("k") == b"v"
    finally:
        server.kill()


@pytest.fixture
def tls_front(redis_url: str, tmp_path: Path) -> Iterator[tuple[int, Path]]:
    with certs.tls_front(int(redis_url.rsplit(":", 1)[1].split("/")[0]), tmp_path) as front:
        yield front


def test_rediss_verifies_the_servers_certificate_against_the_ca_given(
    tls_front: tuple[int, Path], rclient: redis.Redis, tmp_path: Path
) -> None:
    port, ca = tls_front
    rclient.set("over", "tls")
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
    assert quick(url).get("over") == b"tls"
    _, _, other_ca = certs.self_signed(tmp_path / "other")
    with pytest.raises(RedisUnavailableError) as refused:
        quick(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={other_ca}").ping()
    assert "certificate verify failed" in str(refused.value)


def test_a_urls_deadlines_are_honoured_as_redis_py_honours_them(redis_url: str) -> None:
    # Given a URL that names its own deadline
    client = quick_redis.connect(Settings(redis_url=f"{redis_url}?socket_timeout=7&socket_connect_timeout=2"))
    # Then the read client keeps it, as redis-py would
    assert isinstance(client, QuickRedis) and client.ping()
    assert client._sock is not None and client._sock.gettimeout() == 7


@pytest.mark.parametrize(
    "command", [["status", "--run", "r", "--json"], ["status", "--run", "r"], ["runs", "--json"], ["runs"]]
)
def test_the_read_only_commands_do_not_import_redis_py_nor_the_transitions(
    command: list[str], tmp_path: Path, redis_url: str, rclient: redis.Redis
) -> None:
    """What keeps ``tokenmill status`` fast to start (docs/benchmarks-history/startup.md): redis-py's import
    is most of a call's CPU, and the ledger's transitions (with the job spec and Celery's message
    format) added a fifth more (bench/startup.py, 2026-12-06)."""
    Enqueuer(Ledger(rclient, "r"), Routing(model="m"), 10).enqueue_file(
        write_jsonl(tmp_path / "A.jsonl", [{"prompt": "p"}])
    )
    probe = (
        "import sys\nfrom tokenmill.cli import main\n"
        f"main({command!r})\n"
        "heavy = sorted({'redis', 'tokenmill.transitions'} & set(sys.modules))\n"
        "print(f'imported {heavy}' if heavy else 'redis-py not imported')"
    )
    res = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"TOKENMILL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip().endswith("redis-py not imported"), res.stdout
