"""Session fixtures: one private redis-server (AOF on) for the session, flushed per test, and the
engines modules share (``engine_pool``)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.engines import ENGINE_PARAMS, SHARED_ENGINES, Engine, EnginePool
from tests.procs import Proc, RedisServer, start_s3
from tests.timeouts import (  # noqa: F401 (hooks)
    pytest_runtest_protocol,
    pytest_timeout_cancel_timer,
    pytest_timeout_set_timer,
)

SGLANG_UNIT = "real SGLang"
SGLANG_PARAM = "sglang"  # the id of the real engine in tests.engines.ENGINE_PARAMS
SGLANG_MODULES = (  # all real SGLang
    "tests/test_sglang_server.py::",
    "tests/test_sglang_router.py::",
    "tests/test_sglang_affinity.py::",
    "tests/test_sglang_drift.py::",
)


COMPOSE_TESTS = Path(__file__).resolve().parent / "compose"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--compose",
        action="store_true",
        help="also collect tests/compose: compose.yaml built and run in Docker (make test-compose)",
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The container tests build images and start the stack (tens of minutes on a new machine):
    `make test-compose` runs them, with --compose; plain `make test` leaves them out."""
    if collection_path == COMPOSE_TESTS and not config.getoption("--compose"):
        return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    """Tests Ctrl-C child processes (`status --watch`, `server up`). A suite started in the
    background by a non-interactive shell has SIGINT ignored, and an ignored signal stays ignored
    across exec: catch it here, so that children start with the default disposition."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def runs_real_sglang(nodeid: str) -> bool:
    """Whether a test runs real SGLang, from its id alone (xdist's controller sees no markers):
    the ``sglang`` engine parameter, or a module of real-SGLang tests only."""
    params = nodeid.rpartition("[")[2].rstrip("]").split("-") if nodeid.endswith("]") else []
    return SGLANG_PARAM in params or nodeid.startswith(SGLANG_MODULES)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check that :func:`runs_real_sglang` tells the tiers apart the way their ``sglang`` marker
    does; on an xdist worker, put the real-SGLang tests first (stable: module fixtures stay
    together), so that their unit, the longest, starts first."""
    for item in items:
        if (item.get_closest_marker("sglang") is not None) != runs_real_sglang(item.nodeid):
            raise pytest.UsageError(
                f"{item.nodeid}: its sglang marker and runs_real_sglang() disagree (tests/conftest.py)"
            )
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: not runs_real_sglang(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadscope`` each module runs whole on one worker (its module fixtures set
    up once), and here every real-SGLang test in one unit too, run one after another on one
    worker while the others take the rest (``make test-sglang`` runs that tier on its own).
    On two cores, two SGLang servers side by side slowed each other several-fold (a 90 s test ran
    past its 300 s timeout)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SglangApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SGLANG_UNIT if runs_real_sglang(nodeid) else super()._split_scope(nodeid)

    return SglangApart(config, log)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean database on the session's redis-server."""
    if not redis_server.ping():
        redis_server.start()
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def rclient(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    """Processes a test starts; all are stopped (then killed) when it ends."""
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop(timeout=10)


@pytest.fixture(scope="session")
def engine_pool(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EnginePool]:
    """Engines shared by the session's modules (:class:`tests.engines.EnginePool`); the shared
    real-SGLang engines the selected tests use are launched together when the session starts."""
    pool = EnginePool(tmp_path_factory.mktemp("engines"))
    try:
        for name in sorted(_shared_real_engines(request.session.items)):
            pool.launch(SGLANG_PARAM, name)
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session", autouse=True)
def _launch_shared_engines(request: pytest.FixtureRequest) -> None:
    """Start the pool at the session's start when a selected test uses a shared real SGLang."""
    if _shared_real_engines(request.session.items):
        request.getfixturevalue("engine_pool")


def _shared_real_engines(items: list[pytest.Item]) -> set[str]:
    """Names of the shared engines selected tests use on real SGLang: through their
    ``<name>_engine`` fixtures, or named by their module's ``SHARED_REAL_ENGINES``."""
    names = set()
    for item in items:
        names.update(getattr(getattr(item, "module", None), "SHARED_REAL_ENGINES", ()))
        params = getattr(getattr(item, "callspec", None), "params", {})
        for name in SHARED_ENGINES:
            if params.get(f"{name}_engine") == SGLANG_PARAM:
                names.add(name)
    return names


def _shared_engine(name: str) -> Any:
    @pytest.fixture(scope="module", params=ENGINE_PARAMS, name=f"{name}_engine")
    def fixture(request: pytest.FixtureRequest, engine_pool: EnginePool) -> Engine:
        return engine_pool.shared(request.param, name)

    fixture.__doc__ = (
        f"The session's shared ``{name}`` engine (tests.engines.SHARED_ENGINES), sim and SGLang."
    )
    return fixture


plain_engine = _shared_engine("plain")
tools_engine = _shared_engine("tools")
qwen3_engine = _shared_engine("qwen3")
deepseek_engine = _shared_engine("deepseek")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real S3-compatible server (moto, server mode) on loopback for the session: the
    environment variables that point a client at it."""
    proc, env = start_s3(tmp_path_factory.mktemp("s3"))
    yield env
    proc.kill()


@pytest.fixture
def s3_env(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``s3_server``'s environment, also set in this process (s3fs reads it from there)."""
    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    return s3_server
