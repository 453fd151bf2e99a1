"""A batch of ``tokenmill api``: its record (a Redis hash of OpenAI's Batch fields) and the one
transition every status change goes through.

Statuses: ``validating → in_progress → finalizing → completed``; ``validating → failed`` (a bad
input file, nothing enqueued); ``validating | in_progress → cancelling → cancelled``;
``in_progress → finalizing → expired`` once the completion window passed. A change is a compare
and set in one Lua script (:data:`TRANSITION`): of two API processes racing, or a restarted one
redoing a step, one moves the batch and the other is told it did not, so a batch ends once.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import TYPE_CHECKING, Any

import orjson
import redis

from producer.api.errors import bad, not_found
from tokenmill import keys
from tokenmill.counts import run_counts
from tokenmill.replies import text

if TYPE_CHECKING:
    from redis.typing import EncodableT, FieldT

ENDPOINT = "/v1/chat/completions"
PARTITION = "batch"
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TIMES = (
    *("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at"),
    *("failed_at", "expired_at", "cancelling_at", "cancelled_at"),
)

# Pre: the batch's status is one of ARGV[2] (comma-separated). Post: its status is ARGV[3], the
# fields ARGV[4..] (name, value, ...) are set, and a final status takes it out of the active set
# (KEYS[2]). Returns 1, or 0 (nothing changed) when the Pre does not hold.
# KEYS: batch hash, active set. ARGV: batch id, from statuses, to status, fields.
TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or not string.find(',' .. ARGV[2] .. ',', ',' .. status .. ',', 1, true) then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[3], unpack(ARGV, 4))
if string.find(',completed,failed,expired,cancelled,', ',' .. ARGV[3] .. ',', 1, true) then
  redis.call('SREM', KEYS[2], ARGV[1])
end
return 1
"""


def window_s(window: Any) -> int:
    """``completion_window`` in seconds: OpenAI's ``24h``, or any ``<n>s|m|h|d``."""
    match = _WINDOW.match(window) if isinstance(window, str) else None
    if match is None:
        shown = orjson.dumps(window).decode()
        raise bad(
            f"completion_window {shown} is not a duration such as 24h (or 30m, 7d)", "completion_window"
        )
    return int(match[1]) * _UNIT_S[match[2]]


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's bounds: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise bad("metadata must be an object of at most 16 key-value pairs", "metadata")
    for k, v in metadata.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise bad(f"metadata {k[:64]!r}: keys up to 64 characters, values strings up to 512", "metadata")
    return metadata


class Batches:
    """The batches' records and transitions."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._transition = r.register_script(TRANSITION)

    def create(self, input_file_id: str, window: str, metadata: dict[str, str] | None) -> str:
        """Record a new batch, ``validating``; returns its id (which is also its run's name)."""
        batch_id = f"batch_{secrets.token_hex(12)}"
        now = time.time()
        fields: dict[FieldT, EncodableT] = {
            "id": batch_id,
            "status": "validating",
            "input_file_id": input_file_id,
            "endpoint": ENDPOINT,
            "completion_window": window,
            "created_at": int(now),
            "expires_at": int(now) + window_s(window),
            "metadata": orjson.dumps(metadata),
        }
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(keys.api_batch(batch_id), mapping=fields)
        pipe.zadd(keys.api_batches(), {batch_id: int(now * 1000)})
        pipe.sadd(keys.api_active(), batch_id)
        pipe.execute()
        return batch_id

    def fields(self, batch_id: str) -> dict[str, str] | None:
        raw = self.r.hgetall(keys.api_batch(batch_id)) if batch_id.startswith("batch_") else {}
        return {text(k): text(v) for k, v in raw.items()} or None

    def move(self, batch_id: str, sources: tuple[str, ...], to: str, **fields: Any) -> bool:
        """The batch from one of ``sources`` to ``to`` with ``fields`` set; False if it was not in
        any of them (another process moved it first)."""
        flat = [str(x) for kv in fields.items() for x in kv]
        args = [batch_id, ",".join(sources), to, *flat]
        return bool(self._transition(keys=[keys.api_batch(batch_id), keys.api_active()], args=args))

    def active(self) -> list[str]:
        return sorted(text(i) for i in self.r.smembers(keys.api_active()))

    def get(self, batch_id: str) -> dict[str, Any]:
        """OpenAI's Batch object, its request counts read from the run's ledger counts."""
        h = self.fields(batch_id)
        if h is None:
            raise not_found("batch", batch_id)
        return to_object(h, run_counts(self.r, batch_id).get(PARTITION, {}))

    def list(self, after: str | None, limit: int) -> dict[str, Any]:
        from producer.api.files import page

        def load(ids: list[str]) -> list[dict[str, Any]]:
            return [
                to_object(h, run_counts(self.r, i).get(PARTITION, {})) for i in ids if (h := self.fields(i))
            ]

        return page(self.r, keys.api_batches(), after, limit, load)


def to_object(h: dict[str, str], counts: dict[str, int]) -> dict[str, Any]:
    """A batch's record and its run's counts as OpenAI's Batch object."""
    doc: dict[str, Any] = {
        "id": h["id"],
        "object": "batch",
        "endpoint": h["endpoint"],
        "model": None,
        "errors": orjson.loads(h["errors"]) if h.get("errors") else None,
        "input_file_id": h["input_file_id"],
        "completion_window": h["completion_window"],
        "status": h["status"],
        "output_file_id": h.get("output_file_id") or None,
        "error_file_id": h.get("error_file_id") or None,
        "request_counts": {
            "total": sum(counts.values()),
            "completed": counts.get("done", 0),
            "failed": counts.get("failed", 0),
        },
        "metadata": orjson.loads(h.get("metadata") or "null"),
    }
    for name in _TIMES:
        doc[name] = int(h[name]) if h.get(name) else None
    return doc
