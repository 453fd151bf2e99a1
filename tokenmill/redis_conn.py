"""Opening Redis: clear errors that name the (redacted) URL, and the durability check.

Every client has deadlines (redis-py's: ``socket_timeout`` and ``socket_connect_timeout`` 5 s
unless the URL says otherwise; TCP keepalive; a health check after 30 s idle), so that a Redis
host that vanishes costs a command seconds. A ``sentinel://`` URL (:mod:`tokenmill.redis_url`)
gives a client of the primary the sentinels name, found again after a failover.
"""

from __future__ import annotations

import logging
from typing import Any

import hiredis
import redis
import redis.sentinel
from redis.retry import Retry

from tokenmill import redis_url
from tokenmill.errors import PUT_PASSWORD, RedisUnavailableError, failure, refused, unreachable
from tokenmill.redis_retry import BACKOFF
from tokenmill.settings import Settings

log = logging.getLogger("tokenmill.redis")
HEALTH_CHECK_S = 30
# every client's, unless its URL names its own (from_url lets the URL's options win)
DEADLINES: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0, "socket_keepalive": True}


def connect(
    settings: Settings, *, check: bool = True, name: str | None = None, retries: int = 1
) -> redis.Redis:
    """A client for ``settings.redis_url`` (named ``name`` in CLIENT LIST); with ``check``, ping it
    and raise a clear error. ``retries``: redis-py's own retries of a command after a connection
    error or a timeout. One replaces a kept connection Redis dropped; redis-py's default three,
    each waiting out ``socket_timeout``, made a command to a vanished host take ~25 s (a
    ``status`` then said nothing for that long); callers that ride Redis out retry themselves
    (:mod:`tokenmill.redis_retry`, whose backoff this one shares)."""
    url = settings.redis_url
    kw: dict[str, Any] = {"health_check_interval": HEALTH_CHECK_S, "client_name": name}
    kw["retry"] = Retry(BACKOFF, retries)
    if redis_url.is_sentinel(url):
        s = redis_url.parse_sentinel(url)
        at = s.primary
        timeouts: dict[str, Any] = {
            "socket_timeout": at.socket_timeout_s,
            "socket_connect_timeout": at.connect_timeout_s,
        }
        # the sentinels themselves are asked without a password, as kombu asks them
        sentinel = redis.sentinel.Sentinel(list(s.hosts), **timeouts, sentinel_kwargs=timeouts)
        login: dict[str, Any] = {"db": at.db, "username": at.username, "password": at.password}
        client: redis.Redis = sentinel.master_for(
            s.master_name, **login, **timeouts, socket_keepalive=True, **kw
        )
    else:  # redis-py 8's defaults, given for older ones (whose socket_timeout waited forever)
        client = redis.Redis.from_url(url, **DEADLINES, **kw)
    if check:
        ping(client, url)
    return client


def check_credentials(settings: Settings) -> None:
    """Raise a clear :class:`RedisUnavailableError` if Redis refuses our credentials; a Redis
    that cannot be reached (yet) is not an error here (the worker waits for it)."""
    client = connect(settings, check=False, retries=0)
    try:
        ping(client, settings.redis_url)
    except RedisUnavailableError as exc:
        if "credentials" in str(exc) or "needs a password" in str(exc):
            raise
    finally:
        client.close()


def ping(client: redis.Redis, url: str) -> None:
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise refused(exc, url) from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise failure(url, f"needs a password: {exc} {PUT_PASSWORD}") from None
        raise failure(url, f"answered an error: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise unreachable(url, str(exc)) from None


def durability_warnings(client: redis.Redis) -> list[str]:
    """What would make the ledger lose work: AOF off, or an evicting memory policy."""
    warnings: list[str] = []
    try:
        aof = client.config_get("appendonly").get("appendonly")
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.ResponseError:
        return [
            "cannot read Redis's config (CONFIG is disabled): make sure appendonly is yes "
            "and maxmemory-policy is noeviction, or a crash or eviction can lose work"
        ]
    if aof != "yes":
        warnings.append(
            "Redis has appendonly=no: a Redis restart loses every job and result since the last "
            "snapshot. Fix: CONFIG SET appendonly yes (and appendonly yes in redis.conf)"
        )
    if policy and policy != "noeviction":
        warnings.append(
            f"Redis has maxmemory-policy={policy}: under memory pressure Redis may evict jobs and "
            "results. Fix: CONFIG SET maxmemory-policy noeviction (and in redis.conf)"
        )
    return warnings


LISTPACK_VALUE = 8192  # bytes: a job's fields stay in one compact listpack below this


def memory_warnings(client: redis.Redis) -> list[str]:
    """What would double the ledger's memory: a job hash too big for Redis's compact encoding."""
    try:
        value = client.config_get("hash-max-listpack-value").get("hash-max-listpack-value")
    except redis.ResponseError:
        return []
    if value is not None and int(value) < LISTPACK_VALUE:
        return [
            f"Redis has hash-max-listpack-value={value}: a job's hash holds its prompt, so it is "
            "stored as a hashtable, about twice the memory (measured: 2.0x a queued job's prompt "
            f"bytes instead of 1.5x). Fix: CONFIG SET hash-max-listpack-value {LISTPACK_VALUE} "
            "(and in redis.conf)"
        ]
    return []


def warn_durability(client: redis.Redis, echo: object = None) -> None:
    """Log (and optionally print) the durability and memory warnings."""
    for w in durability_warnings(client) + memory_warnings(client):
        log.warning("WARNING: %s", w)
        if callable(echo):
            echo(f"WARNING: {w}")


class CommandStream:
    """Commands sent back to back on one connection of ``client``'s pool, replies read oldest
    first: the caller builds the next command while Redis runs the last. The connection goes back
    to the pool on :meth:`close` (dropped if replies were left unread: they would be read as the
    next command's)."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._conn = self._pool.get_connection()
        self.unread = 0

    def send(self, *command: Any) -> None:
        # Packed by hiredis directly: redis-py's packer first re-checks every argument in Python,
        # ~1 us a row of the producer's ~15 (measured on 200-row batches of bench/enqueue.py's rows).
        self._conn.send_packed_command([hiredis.pack_command(command)])
        self.unread += 1

    def read(self) -> Any:
        """The oldest unread reply (redis-py's error classes for an error reply)."""
        self.unread -= 1
        return self._conn.read_response()

    def close(self) -> None:
        if self.unread:
            self._conn.disconnect()
        self._pool.release(self._conn)
