"""The aiohttp application: routes, API-key auth and uvicorn-style access lines."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web

from server_mgr.sim import endpoints, generate, metrics, tokens
from server_mgr.sim.chat import chat_completions, json_response, peer, read_json
from server_mgr.sim.errors import RequestError
from server_mgr.sim.state import STATE, SimState

# SGLang never asks for the key on these (0.5.23 adds /ready); the sim's own hooks neither.
AUTH_EXEMPT = ("/health", "/metrics", "/ready", "/_sim/")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _authorized(request: web.Request, key: str) -> bool:
    if request.method == "OPTIONS" or request.path.startswith(AUTH_EXEMPT):
        return True
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


@web.middleware
async def frontend(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Auth (401 ``{"error":"Unauthorized"}``), FastAPI-style 404/405 bodies, access lines."""
    state = request.app[STATE]
    key = state.cfg.api_key
    resp: web.StreamResponse
    if key and not _authorized(request, key):
        resp = json_response({"error": "Unauthorized"}, 401)
    else:
        try:
            resp = await handler(request)
        except web.HTTPNotFound:
            resp = json_response({"detail": "Not Found"}, 404)
        except web.HTTPMethodNotAllowed:
            resp = json_response({"detail": "Method Not Allowed"}, 405)
    if not request.get("access_logged"):
        phrase = HTTPStatus(resp.status).phrase
        state.log.access(peer(request), request.method, request.path_qs, resp.status, phrase)
    return resp


async def tokenize(request: web.Request) -> web.StreamResponse:
    """``/tokenize`` and ``/v1/tokenize``: a prompt (or a list of prompts) into the sim's token
    ids, in SGLang's shape ``{"tokens", "count", "max_model_len"}``."""
    try:
        body = await read_json(request)
    except RequestError as exc:
        return json_response(exc.body(), exc.status)
    prompt = body.get("prompt")
    ctx = request.app[STATE].cfg.context_len
    if isinstance(prompt, str):
        ids = tokens.ids(tokens.pieces(prompt))
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": ctx})
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        lists = [tokens.ids(tokens.pieces(p)) for p in prompt]
        return json_response({"tokens": lists, "count": [len(x) for x in lists], "max_model_len": ctx})
    err = RequestError(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
    return json_response(err.body(), err.status)


def build_app(state: SimState) -> web.Application:
    """The sim's routes (SGLang 0.5.23's, plus ``/_sim/*``)."""
    app = web.Application(middlewares=[frontend], client_max_size=64 * 1024**2)
    app[STATE] = state
    e = endpoints
    get, post = web.get, web.post
    routes = [
        get("/health", e.health),
        get("/health_generate", e.health),
        get("/ready", e.ready),
        get("/ping", e.ping),
        get("/server_info", e.get_server_info),
        get("/get_server_info", e.get_server_info),
        get("/model_info", e.get_model_info),
        get("/get_model_info", e.get_model_info),
        get("/v1/models", e.list_models),
        get("/v1/models/{name:.+}", e.get_model),
        post("/v1/chat/completions", chat_completions),
        post("/invocations", chat_completions),
        post("/tokenize", tokenize),
        post("/v1/tokenize", tokenize),
        post("/generate", generate.generate),
        get("/v1/loads", e.loads),
        get("/flush_cache", e.flush_cache),
        post("/flush_cache", e.flush_cache),
        post("/abort_request", e.abort_request),
        post("/_sim/fault", e.sim_fault),
        get("/_sim/stats", e.sim_stats),
    ]
    if state.cfg.enable_metrics:
        routes.append(get("/metrics", metrics.metrics))
    app.add_routes(routes)
    return app
