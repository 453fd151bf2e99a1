"""Files of ``tokenmill api``: OpenAI's File objects. A file's bytes are in the result store
(``<store>/_api/files/<id>.jsonl``, a directory or ``s3://…``), written and read in chunks, never
whole in memory; its record (OpenAI's fields) is a Redis hash, listed newest first."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Generator
from typing import Any, cast

import orjson
import redis

from producer.api.errors import ApiError, bad, not_found
from producer.result_store import ResultStore
from tokenmill import keys
from tokenmill.replies import text

CHUNK = 1 << 20


def new_id() -> str:
    """A new file id, OpenAI-like (``file-`` and 24 hex digits)."""
    return f"file-{secrets.token_hex(12)}"


def page(
    r: redis.Redis, index: str, after: str | None, limit: int, load: Callable[[list[str]], list[Any]]
) -> dict[str, Any]:
    """OpenAI's list object of the ids in ``index`` (a sorted set), newest first, from the one
    after ``after``: ``{"object": "list", "data", "first_id", "last_id", "has_more"}``; ``load``
    turns ids into objects, leaving out those it drops (a filter)."""
    start = 0
    if after:
        rank = cast("int | None", r.zrevrank(index, after))  # redis-py's type allows withscore
        if rank is None:
            raise not_found("object", after, "after")
        start = rank + 1
    data: list[Any] = []
    has_more = False
    while len(data) <= limit:
        ids = [i.decode() for i in cast("list[bytes]", r.zrevrange(index, start, start + limit))]
        if not ids:
            break
        start += len(ids)
        data += load(ids)
    if len(data) > limit:
        data, has_more = data[:limit], True
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


class Files:
    """The files: records in Redis, bytes in ``store``."""

    def __init__(self, r: redis.Redis, store: ResultStore) -> None:
        self.r = r
        self.store = store

    def path(self, file_id: str) -> str:
        return self.store.path("_api", "files", f"{file_id}.jsonl")

    def record(self, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        """Record a file whose bytes are stored; returns its object. Recording it again (a
        finalization done twice) keeps its first creation time."""
        now = time.time()
        key = keys.api_file(file_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.hsetnx(key, "created_at", int(now))
        pipe.hset(key, mapping={"id": file_id, "bytes": size, "filename": filename, "purpose": purpose})
        pipe.zadd(keys.api_files(), {file_id: int(now * 1000)}, nx=True)
        pipe.execute()
        return self.get(file_id)

    def find(self, file_id: str) -> dict[str, Any] | None:
        raw = self.r.hgetall(keys.api_file(file_id)) if file_id.startswith("file-") else {}
        if not raw:
            return None
        h = {text(k): text(v) for k, v in raw.items()}
        return {
            "id": h["id"],
            "object": "file",
            "bytes": int(h["bytes"]),
            "created_at": int(h["created_at"]),
            "filename": h["filename"],
            "purpose": h["purpose"],
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }

    def get(self, file_id: str, param: str | None = None) -> dict[str, Any]:
        """The file's object; a 404 naming it when there is none."""
        found = self.find(file_id)
        if found is None:
            raise not_found("file", file_id, param)
        return found

    def list(self, purpose: str | None, after: str | None, limit: int) -> dict[str, Any]:
        def load(ids: list[str]) -> list[dict[str, Any]]:
            found = (self.find(i) for i in ids)
            return [f for f in found if f is not None and purpose in (None, f["purpose"])]

        return page(self.r, keys.api_files(), after, limit, load)

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        self.store.remove(self.path(file_id))
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(keys.api_file(file_id))
        pipe.zrem(keys.api_files(), file_id)
        pipe.execute()
        return {"id": file_id, "object": "file", "deleted": True}

    def chunks(self, file_id: str) -> Generator[bytes, None, None]:
        """The file's bytes, a chunk at a time (a 404 when its record or its bytes are gone)."""
        self.get(file_id)
        try:
            fh = self.store.reader(self.path(file_id))
        except FileNotFoundError:
            raise ApiError(404, f"the content of file {file_id!r} is missing from the store", None) from None
        with fh:
            while chunk := fh.read(CHUNK):
                yield chunk


def check_purpose(purpose: str | None) -> str:
    """``purpose`` if this API stores files of it (a 400 naming it otherwise)."""
    if purpose != "batch":
        shown = orjson.dumps(purpose).decode()
        why = "tokenmill api stores batch files (purpose=batch)"
        raise bad(f"purpose {shown} is not supported: {why}", "purpose")
    return purpose
