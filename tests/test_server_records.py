"""The published server records (tokenmill.servers) and `server status`."""

from __future__ import annotations

import json
import time

import redis
from click.testing import CliRunner

from server_mgr.cli import server
from tokenmill import keys, servers
from tokenmill.servers import ServerRecord


def test_a_published_record_loads_back_with_its_live_figures(rclient: redis.Redis) -> None:
    record = ServerRecord(
        name="gpu0",
        url="http://h:30000",
        state=servers.READY,
        pid=42,
        restarts=2,
        max_total_num_tokens=159000,
        context_length=32768,
        last_error="killed: x",
        updated_at=1700000000.5,
        live={"running_req": 5.0, "token_usage": 0.29},
    )
    servers.publish(rclient, record)
    assert servers.load(rclient, "gpu0") == record
    assert rclient.hget(keys.server("gpu0"), "live.running_req") == b"5.0"
    assert rclient.smembers(keys.servers()) == {b"gpu0"}


def test_unknown_values_load_as_none_and_update_merges_fields(rclient: redis.Redis) -> None:
    servers.publish(rclient, ServerRecord(name="b", url="u", state=servers.STARTING, engine="sim"))
    servers.update(
        rclient,
        "b",
        state=servers.READY,
        max_total_num_tokens=1000,
        live={"queue_req": 3},
        mem_fraction_static=0.84,
    )
    loaded = servers.load(rclient, "b")
    assert loaded is not None and loaded.pid is None and loaded.engine == "sim"
    assert (loaded.state, loaded.max_total_num_tokens, loaded.live) == ("ready", 1000, {"queue_req": 3.0})
    assert loaded.updated_at > time.time() - 5
    assert rclient.hget(keys.server("b"), "mem_fraction_static") == b"0.84"
    servers.publish(rclient, ServerRecord(name="a", url="u", state=servers.DOWN))
    assert [r.name for r in servers.load_all(rclient)] == ["a", "b"]
    assert servers.load(rclient, "nope") is None


def test_events_are_kept_newest_first_and_trimmed_to_200(rclient: redis.Redis) -> None:
    for i in range(205):
        servers.record_event(rclient, "s", "restart", f"#{i}", n=i)
    events = [json.loads(e) for e in rclient.lrange(keys.server_events("s"), 0, -1)]
    assert len(events) == 200 and events[0]["n"] == 204 and events[0]["kind"] == "restart"


def test_server_status_reads_redis_as_json_and_as_a_table(rclient: redis.Redis, redis_url: str) -> None:
    servers.publish(
        rclient,
        ServerRecord(
            name="gpu0",
            url="http://h:1",
            state=servers.READY,
            engine="sim",
            pid=7,
            max_total_num_tokens=200000,
            context_length=32768,
            updated_at=time.time(),
            live={"running_req": 4.0},
        ),
    )
    env = {"TOKENMILL_REDIS_URL": redis_url}
    result = CliRunner().invoke(server, ["status", "--json"], env=env)
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)["servers"][0]
    assert {
        k: row[k]
        for k in (
            "name",
            "engine",
            "url",
            "state",
            "pid",
            "restarts",
            "max_total_num_tokens",
            "context_length",
            "last_error",
        )
    } == {
        "name": "gpu0",
        "engine": "sim",
        "url": "http://h:1",
        "state": "ready",
        "pid": 7,
        "restarts": 0,
        "max_total_num_tokens": 200000,
        "context_length": 32768,
        "last_error": "",
    }
    assert row["live"] == {"running_req": 4.0} and row["stale"] is False
    table = CliRunner().invoke(server, ["status"], env=env).output
    assert table.splitlines()[1].split()[:4] == ["gpu0", "sim", "ready", "http://h:1"]
