"""Opening Redis: clear errors that name the (redacted) URL, and the durability check."""

from __future__ import annotations

import logging

import redis
import redis.asyncio as aioredis

from tokenmill.errors import RedisUnavailableError
from tokenmill.settings import Settings, redact_url

log = logging.getLogger("tokenmill.redis")


def connect(settings: Settings, *, check: bool = True, name: str | None = None) -> redis.Redis:
    """A client for ``settings.redis_url`` (named ``name`` in CLIENT LIST); with ``check``, ping it
    and raise a clear error."""
    url = settings.redis_url
    client = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30, client_name=name)
    if check:
        ping(client, url)
    return client


def connect_async(settings: Settings) -> aioredis.Redis:
    return aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=5)


def ping(client: redis.Redis, url: str) -> None:
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise RedisUnavailableError(
            f"Redis at {redact_url(url)} refused the credentials: {exc} "
            "(check the password in TOKENMILL_REDIS_URL)"
        ) from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise RedisUnavailableError(
                f"Redis at {redact_url(url)} needs a password: {exc} "
                "(put it in TOKENMILL_REDIS_URL as redis://:PASSWORD@host:port/db)"
            ) from None
        raise RedisUnavailableError(f"Redis at {redact_url(url)} answered an error: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise RedisUnavailableError(
            f"cannot reach Redis at {redact_url(url)}: {exc} (is it running? set TOKENMILL_REDIS_URL)"
        ) from None


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


def warn_durability(client: redis.Redis, echo: object = None) -> list[str]:
    """Log (and optionally print) the durability and memory warnings; returns them."""
    found = durability_warnings(client) + memory_warnings(client)
    for w in found:
        log.warning("WARNING: %s", w)
        if callable(echo):
            echo(f"WARNING: {w}")
    return found
