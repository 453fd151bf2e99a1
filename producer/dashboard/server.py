"""The dashboard's web server: the page, its static files, and a JSON API over ``tokenmill.Client``.

Every route, the static files included, answers only a request whose ``Host`` is an allowed name
(a web page cannot read it through a rebound name of its own), and is behind basic auth when
credentials are configured. Every answer, errors included, carries the security headers.
The API's answers are the Python API's documents, unchanged: ``api/status`` is
``Client.status(run).to_dict()``, the ``tokenmill status --json`` document; ``api/runs`` the
``tokenmill runs --json`` one; ``api/flagged`` is ``Client.flagged_jobs(run)`` (the latest jobs
each quality flag was set on), ``api/samples?partition=P&job=ID`` that job's sample. The Client's calls
block on Redis, so each runs in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import redis
from aiohttp import web

from producer.web_access import authorized, host_allowed
from tokenmill.errors import ConfigError, RedisUnavailableError, TokenmillError

if TYPE_CHECKING:
    from producer.client import Client

log = logging.getLogger("tokenmill.dashboard")

REALM = "tokenmill dashboard"
HOSTS_SETTING = "TOKENMILL_DASHBOARD_ALLOWED_HOSTS"
MAX_SAMPLES = 20  # per partition: the recent list keeps 20 ids
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The page loads its scripts, styles and data from this server only (and draws on canvases).
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}


def static_dir() -> Path:
    """The page's files, shipped in the package (``producer/dashboard/static``)."""
    return Path(str(resources.files("producer.dashboard").joinpath("static")))


def make_app(client: Client, credentials: list[str], hosts: frozenset[str]) -> web.Application:
    """The dashboard's application: the page at ``/``, its files under ``static/``, the API under
    ``api/``; every request's ``Host`` one of ``hosts`` and its authorization one of
    ``credentials`` (none: open, loopback only)."""
    app = web.Application(middlewares=[_guard(credentials, hosts)])
    app.on_response_prepare.append(secure)
    api = _Api(client)
    app.router.add_get("/", _index)
    app.router.add_get("/favicon.ico", _no_content)
    app.router.add_get("/api/runs", api.runs)
    app.router.add_get("/api/status", api.status)
    app.router.add_get("/api/history", api.history)
    app.router.add_get("/api/samples", api.samples)
    app.router.add_get("/api/flagged", api.flagged)
    app.router.add_static("/static/", static_dir(), follow_symlinks=False)
    return app


def _guard(credentials: list[str], hosts: frozenset[str]) -> Any:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not host_allowed(host, hosts):
            names = ", ".join(sorted(hosts))
            return web.Response(
                status=421,
                text=f"421: Host {host!r} is not a name this dashboard answers to ({names}); "
                f"add its name to {HOSTS_SETTING} to allow it\n",
            )
        if not authorized(request.headers.get("Authorization"), credentials):
            return web.Response(
                status=401,
                text="401: authentication required\n",
                headers={"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
            )
        return await handler(request)

    return guard


async def secure(request: web.Request, response: web.StreamResponse, static: bool = True) -> None:
    """Run on every response before it is sent, errors included (a raised 4xx, aiohttp's own
    404 and 405, an unhandled error's 500): the security headers, and no caching but of the
    static files (none with ``static`` False: the API's)."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    if not (static and request.path.startswith("/static/")):
        response.headers.setdefault("Cache-Control", "no-store")


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(static_dir() / "index.html")


async def _no_content(request: web.Request) -> web.StreamResponse:
    return web.Response(status=204)


class _Api:
    """The JSON routes; each answers a document of the Python API, or ``{"error": ...}``."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def runs(self, request: web.Request) -> web.StreamResponse:
        return await _answer(lambda: {"runs": [info.to_dict() for info in self.client.runs()]})

    async def status(self, request: web.Request) -> web.StreamResponse:
        run = _run(request)
        return await _answer(lambda: self.client.status(run).to_dict())

    async def history(self, request: web.Request) -> web.StreamResponse:
        run = _run(request)
        since = _int(request, "since", None, 0)
        return await _answer(lambda: self.client.history(run, since))

    async def samples(self, request: web.Request) -> web.StreamResponse:
        run = _run(request)
        n = _int(request, "n", 3, 1, MAX_SAMPLES)
        partition = request.query.get("partition") or None
        job = request.query.get("job") or None
        if job is not None and partition is None:
            raise _bad("job needs its partition (api/samples?run=NAME&partition=P&job=ID)")
        return await _answer(lambda: self.client.samples(run, n, partition=partition, job_id=job))

    async def flagged(self, request: web.Request) -> web.StreamResponse:
        run = _run(request)
        return await _answer(lambda: self.client.flagged_jobs(run))


def _run(request: web.Request) -> str:
    run = request.query.get("run", "")
    if not run:
        raise _bad("the run parameter is required (api/status?run=NAME)")
    return run


def _int(request: web.Request, name: str, default: int | None, low: int, high: int | None = None) -> Any:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _bad(f"{name}={raw!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        raise _bad(f"{name}={value} is out of range ({low}..{high if high is not None else ''})")
    return value


def _bad(message: str) -> web.HTTPException:
    return web.HTTPBadRequest(text=orjson.dumps({"error": message}).decode(), content_type="application/json")


async def _answer(read: Callable[[], Any]) -> web.Response:
    """``read()`` (a blocking Client call, run in a thread) as JSON; a tokenmill error as a 4xx
    naming what was wrong, an unreachable Redis as a 503."""
    try:
        doc = await asyncio.to_thread(read)
    except ConfigError as exc:  # an unknown run or partition: the message names it
        return as_json({"error": str(exc)}, 404)
    except RedisUnavailableError as exc:
        return as_json({"error": str(exc)}, 503)
    except TokenmillError as exc:
        return as_json({"error": str(exc)}, 400)
    except redis.RedisError as exc:
        log.warning("dashboard: Redis unavailable: %s", exc)
        return as_json({"error": f"Redis is unavailable: {exc}"}, 503)
    return as_json(doc)


def as_json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS),
        status=status,
        content_type="application/json",
    )
