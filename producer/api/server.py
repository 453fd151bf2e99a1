"""The web server of ``tokenmill api``: OpenAI's Files, Batches and Models routes over aiohttp.

Every route answers only a request whose ``Host`` is an allowed name (as the dashboard) and,
when keys are configured, that carries one as ``Authorization: Bearer <key>`` (compared in
constant time, loopback included). Every error is OpenAI's shape with its status: 400 for a bad
request, 401 ``invalid_api_key``, 404, 405, 413 for a file over ``TOKENMILL_API_MAX_FILE_BYTES``,
503 when Redis is away. Uploads stream into the result store and downloads stream out of it, a
chunk at a time. Redis, the store and the servers are reached in threads (blocking clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import redis
from aiohttp import BodyPartReader, web

from producer.api import files as files_mod
from producer.api.batches import ENDPOINT, Batches, check_metadata, window_s
from producer.api.errors import ApiError, bad
from producer.api.files import Files
from producer.api.lifecycle import Lifecycle
from producer.dashboard.server import as_json, secure
from producer.web_access import authorized, host_allowed
from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.api")

HOSTS_SETTING = "TOKENMILL_API_ALLOWED_HOSTS"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(
    r: redis.Redis, settings: Settings, files: Files, keys_: list[str], hosts: frozenset[str]
) -> web.Application:
    """The application; its background loop advances the active batches."""
    app = web.Application(middlewares=[_errors, _guard(keys_, hosts)])
    app.on_response_prepare.append(functools.partial(secure, static=False))
    api = _Api(r, settings, files)
    app.router.add_post("/v1/files", api.upload)
    app.router.add_get("/v1/files", api.list_files)
    app.router.add_get("/v1/files/{id}", api.get_file)
    app.router.add_delete("/v1/files/{id}", api.delete_file)
    app.router.add_get("/v1/files/{id}/content", api.content)
    app.router.add_post("/v1/batches", api.create_batch)
    app.router.add_get("/v1/batches", api.list_batches)
    app.router.add_get("/v1/batches/{id}", api.get_batch)
    app.router.add_post("/v1/batches/{id}/cancel", api.cancel_batch)
    app.router.add_get("/v1/models", api.models)
    app.cleanup_ctx.append(api.background)
    return app


def _guard(keys_: list[str], hosts: frozenset[str]) -> Any:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host")
        if not host_allowed(host, hosts):
            raise ApiError(421, f"Host {host!r} is not a name this API answers to; add it to {HOSTS_SETTING}")
        if not authorized(request.headers.get("Authorization"), keys_, "bearer"):
            why = "Incorrect API key provided (Authorization: Bearer <key>, one of TOKENMILL_API_KEYS)"
            raise ApiError(401, why, None, "invalid_api_key")
        return await handler(request)

    return guard


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as OpenAI's error body with its status."""
    try:
        return await handler(request)
    except ApiError as exc:
        error = exc
    except web.HTTPException as exc:  # the router's 404 and 405
        if exc.status < 400:
            raise
        what = "Unknown route" if exc.status == 404 else f"Method {request.method} not allowed on"
        error = ApiError(exc.status, f"{what} {request.path}", None, None)
    except redis.RedisError as exc:
        log.warning("api: Redis unavailable: %s", exc)
        error = ApiError(503, f"Redis is unavailable: {exc}")
    return web.json_response(error.body(), status=error.status, dumps=lambda d: orjson.dumps(d).decode())


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 10000:
        raise bad(f"limit={raw!r} must be an integer from 1 to 10000", "limit")
    return int(raw)


class _Api:
    def __init__(self, r: redis.Redis, settings: Settings, files: Files) -> None:
        self.r = r
        self.settings = settings
        self.files = files
        self.batches = Batches(r)
        self.life = Lifecycle(r, settings, files, self.batches)
        self.kick = asyncio.Event()

    # -- files ------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.StreamResponse:
        limit = self.settings.api_max_file_bytes
        if request.content_length is not None and request.content_length > limit + (1 << 20):
            raise self._too_large(request.content_length)
        if not request.content_type.startswith("multipart/"):
            raise bad("send the file as multipart/form-data with fields file and purpose", "file")
        reader = await request.multipart()
        purpose = filename = None
        stored: tuple[str, int] | None = None
        try:
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise bad("nested multipart bodies are not supported", "file")
                if part.name == "purpose":
                    purpose = files_mod.check_purpose((await part.text()).strip())
                elif part.name == "file" and stored is None:
                    filename = part.filename or "upload.jsonl"
                    stored = await self._store(part, limit)
                else:
                    await part.release()
            if stored is None:
                raise bad("the form has no file field", "file")
            files_mod.check_purpose(purpose)
        except BaseException:
            if stored is not None:
                await asyncio.to_thread(self.files.store.remove, self.files.path(stored[0]))
            raise
        doc = await asyncio.to_thread(self.files.record, stored[0], filename or "", "batch", stored[1])
        return as_json(doc)

    async def _store(self, part: BodyPartReader, limit: int) -> tuple[str, int]:
        """The part's bytes into the store, a chunk at a time; (file id, size)."""
        file_id = files_mod.new_id()
        size = 0
        with self.files.store.writer(self.files.path(file_id)) as fh:
            while chunk := await part.read_chunk(files_mod.CHUNK):
                size += len(chunk)
                if size > limit:
                    raise self._too_large(size)
                await asyncio.to_thread(fh.write, chunk)
        return file_id, size

    def _too_large(self, size: int) -> ApiError:
        limit = self.settings.api_max_file_bytes
        return ApiError(413, f"the file is over {limit} bytes ({size}; TOKENMILL_API_MAX_FILE_BYTES)", "file")

    async def list_files(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        doc = await asyncio.to_thread(self.files.list, q.get("purpose"), q.get("after"), _limit(request))
        return as_json(doc)

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        return as_json(await asyncio.to_thread(self.files.get, request.match_info["id"]))

    async def delete_file(self, request: web.Request) -> web.StreamResponse:
        return as_json(await asyncio.to_thread(self.files.delete, request.match_info["id"]))

    async def content(self, request: web.Request) -> web.StreamResponse:
        chunks = self.files.chunks(request.match_info["id"])
        try:
            chunk = await asyncio.to_thread(next, chunks, b"")  # a missing file is a 404, before any byte
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            await response.prepare(request)
            while chunk:
                await response.write(chunk)
                chunk = await asyncio.to_thread(next, chunks, b"")
            await response.write_eof()
            return response
        finally:  # the store's file is closed even when the client went away mid-download
            await asyncio.to_thread(chunks.close)

    # -- batches ----------------------------------------------------------------------------

    async def create_batch(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise bad(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object")
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise bad(
                "input_file_id is required (the id of a file uploaded with purpose batch)", "input_file_id"
            )
        if body.get("endpoint") != ENDPOINT:
            shown = orjson.dumps(body.get("endpoint")).decode()
            raise bad(f"endpoint {shown} is not supported: tokenmill runs {ENDPOINT}", "endpoint")
        window = body.get("completion_window")
        window_s(window)
        assert isinstance(window, str)  # window_s raised a 400 otherwise
        metadata = check_metadata(body.get("metadata"))
        found = await asyncio.to_thread(self.files.get, file_id, "input_file_id")
        if found["purpose"] != "batch":
            raise bad(f"file {file_id} has purpose {found['purpose']!r}, not 'batch'", "input_file_id")
        batch_id = await asyncio.to_thread(self.batches.create, file_id, window, metadata)
        self.kick.set()
        return as_json(await asyncio.to_thread(self.batches.get, batch_id))

    async def get_batch(self, request: web.Request) -> web.StreamResponse:
        return as_json(await asyncio.to_thread(self.batches.get, request.match_info["id"]))

    async def list_batches(self, request: web.Request) -> web.StreamResponse:
        doc = await asyncio.to_thread(self.batches.list, request.query.get("after"), _limit(request))
        return as_json(doc)

    async def cancel_batch(self, request: web.Request) -> web.StreamResponse:
        batch_id = request.match_info["id"]
        doc = await asyncio.to_thread(self.batches.get, batch_id)
        if doc["status"] not in ("cancelling", "cancelled"):
            now = int(time.time())
            sources = ("validating", "in_progress")
            if not await asyncio.to_thread(
                self.batches.move, batch_id, sources, "cancelling", cancelling_at=now
            ):
                why = "only a validating or in_progress batch can be cancelled"
                raise bad(f"batch {batch_id} is {doc['status']}: {why}")
            self.kick.set()
        return as_json(await asyncio.to_thread(self.batches.get, batch_id))

    # -- models -----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        return as_json(await asyncio.to_thread(self._models))

    def _models(self) -> dict[str, Any]:
        """The union of what each server lists on its ``/v1/models``."""
        from tokenmill import capacity, servers
        from tokenmill.url_secrets import redact_url

        urls = dict.fromkeys([*self.settings.server_urls, *(s.url for s in servers.load_all(self.r))])
        cards: dict[str, dict[str, Any]] = {}
        failed = []
        for url in urls:
            try:
                listed = capacity.get_json(url + "/v1/models", self.settings.api_key, 5.0).get("data") or []
            except (OSError, ValueError) as exc:
                failed.append(f"{redact_url(url)} ({exc})")
                continue
            for card in listed:
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    cards.setdefault(card["id"], _card(card))
        if not cards and failed:
            raise ApiError(503, "no server answered /v1/models: " + "; ".join(failed))
        return {"object": "list", "data": list(cards.values())}

    # -- the background loop ----------------------------------------------------------------

    async def background(self, app: web.Application) -> Any:
        task = asyncio.create_task(self._advance_forever())
        yield
        task.cancel()

    async def _advance_forever(self) -> None:
        """Each active batch advanced by a task of its own, one step at a time, every
        ``api_poll_s`` or at once when a request asks (a batch created or cancelled)."""
        running: dict[str, asyncio.Task[None]] = {}
        while True:
            running = {b: task for b, task in running.items() if not task.done()}
            try:
                for batch_id in await asyncio.to_thread(self.batches.active):
                    if batch_id not in running:
                        running[batch_id] = asyncio.create_task(self._step(batch_id))
            except redis.RedisError as exc:
                log.warning("api: cannot list active batches: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.kick.wait(), self.settings.api_poll_s)
            self.kick.clear()

    async def _step(self, batch_id: str) -> None:
        try:
            await asyncio.to_thread(self.life.advance, batch_id)
        except redis.RedisError as exc:
            log.warning("api: batch %s: Redis unavailable (tried again next pass): %s", batch_id, exc)
        except Exception:
            log.exception("api: batch %s: step failed (tried again next pass)", batch_id)


def _card(card: dict[str, Any]) -> dict[str, Any]:
    """A server's model card as OpenAI's Model object."""
    owner = card.get("owned_by") or "tokenmill"
    return {"id": card["id"], "object": "model", "created": card.get("created") or 0, "owned_by": owner}
