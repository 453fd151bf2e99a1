"""Redis through one door: only the client modules open connections to Redis.

redis-py (``tokenmill/redis_conn.py``: every synchronous client, Sentinel included), the
read-only commands' client (``tokenmill/quick_redis.py``: redis-py's import is most of a
``status`` call's CPU) and the worker loop's pipelined client (``tokenmill/redis_async.py``).
Everything else asks one of them; Celery's broker connection (kombu's) is Celery's own.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.procs import ROOT
from tests.test_layers import fresh

CLIENT_MODULES = {"tokenmill/redis_conn.py", "tokenmill/quick_redis.py", "tokenmill/redis_async.py"}
# what opens a connection: redis-py's constructors and Sentinel, or the parts a hand-written client
# is made of (hiredis, redis-py's connection classes, its asyncio client)
OPENERS = {"Redis", "StrictRedis", "from_url", "Sentinel", "master_for", "Connection", "ConnectionPool"}
CLIENT_PARTS = ("hiredis", "redis.asyncio", "redis.sentinel", "redis.connection")


def openings(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if name in OPENERS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: calls {name}()")
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        for name in names:
            if name.startswith(CLIENT_PARTS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}")
    return found


def all_openings() -> list[str]:
    """What every module of the product but the client modules opens."""
    paths = [
        p
        for top in ("tokenmill", "producer", "workers", "server_mgr")
        for p in sorted((ROOT / top).rglob("*.py"))
        if str(p.relative_to(ROOT)) not in CLIENT_MODULES and "/sim/" not in str(p)
    ]
    return [found for p in paths for found in openings(p)]


def test_only_the_client_modules_open_redis_connections() -> None:
    # Given every module of the product but the client modules
    # Then none opens a connection to Redis itself (parsed in a new interpreter: test_layers.fresh)
    assert fresh("test_one_door.all_openings()") == []


def test_a_new_opening_is_caught(tmp_path: Path) -> None:
    probe = ROOT / "workers" / "_door_probe.py"
    probe.write_text("import redis\nimport redis.asyncio\nclient = redis.Redis.from_url('redis://x')\n")
    try:
        assert openings(probe) == [
            "workers/_door_probe.py:2: imports redis.asyncio",
            "workers/_door_probe.py:3: calls from_url()",
        ]
    finally:
        probe.unlink()
