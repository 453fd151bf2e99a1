"""The worker's view of its servers (workers/pool.py): a failed request asks the server's
``/health``; many failures at once on a server just found down do not each wait on a probe."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest
import redis

from tokenmill.settings import Settings
from workers.pool import ServerPool


class Health(http.server.BaseHTTPRequestHandler):
    """``/health`` answering the class's ``status``; counts the probes."""

    status = 503
    probes = 0

    def do_GET(self) -> None:
        type(self).probes += 1
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[Health]]]:
    handler = type("H", (Health,), {})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_server_found_down_is_not_probed_again_at_once_and_is_ready_once_it_answers(
    server: tuple[str, type[Health]], rclient: redis.Redis
) -> None:
    url, health = server
    pool = ServerPool(Settings.load(env={}, server_url=url), rclient)
    assert not pool.found_down(url)

    # a failed request: /health answers 503, so the server is down
    assert pool.is_down(url)
    assert health.probes == 1 and pool.found_down(url)

    # the other streams that fail with it take that answer, with no probe of their own
    assert all(pool.is_down(url) for _ in range(5))
    assert health.probes == 1

    # once /health answers 200, the worker sees the server ready again
    health.status = 200
    assert pool.ready_views()
    assert not pool.found_down(url)
