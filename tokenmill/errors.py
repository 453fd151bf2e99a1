"""The one exception tree of tokenmill.

Every error tokenmill raises on purpose derives from :class:`TokenmillError`. Errors that end a
job are split into :class:`TerminalError` (the job ends ``failed``) and :class:`RetryableError`
(the job goes back to ``queued`` with a backoff); ``workers.taxonomy`` is the one place that maps
a server's answer onto these classes, and the worker maps the classes onto ledger states.
"""

from __future__ import annotations

from typing import Any

from tokenmill.url_secrets import redact_url


class TokenmillError(Exception):
    """Base of every tokenmill error."""


class StopReached(TokenmillError):
    """Not an error: a stream's line handler ends the stream at a stop string that straddles a
    checkpoint (``workers.stream.StopGuard``); the attempt ends as SGLang would have ended it."""


# --- configuration and input -------------------------------------------------------------------


class ConfigError(TokenmillError):
    """A setting, flag or config file value is invalid; the message names it."""


class MissingExtraError(ConfigError, ImportError):
    """An optional package is not installed (``pip install 'tokenmill[EXTRA]'``); names both."""


class LossyKvCacheError(ConfigError):
    """A server config asks for a lossy KV cache dtype without ``allow_lossy_kv_cache = true``."""


class InputError(TokenmillError):
    """A dataset row or file is invalid; ``source`` names it (``file:line``)."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


class IdConflictError(InputError):
    """The same job id arrived with different content: both sources are named."""

    def __init__(self, source: str, job_id: str, prior_source: str) -> None:
        super().__init__(
            source,
            f"job id {job_id!r} was already enqueued from {prior_source} with different content; "
            "not overwritten",
        )
        self.job_id = job_id
        self.prior_source = prior_source


# --- infrastructure ------------------------------------------------------------------------------


class RedisUnavailableError(TokenmillError):
    """Redis cannot be reached or refused us; the message names the (redacted) URL."""


# how a failure of Redis is worded, alike by every client (quick_redis, redis_conn, redis_retry)
PUT_PASSWORD = "(put it in TOKENMILL_REDIS_URL as redis://:PASSWORD@host:port/db)"


def unreachable(url: str, why: str) -> RedisUnavailableError:
    return RedisUnavailableError(
        f"cannot reach Redis at {redact_url(url)}: {why} (is it running? set TOKENMILL_REDIS_URL)"
    )


def failure(url: str, what: str) -> RedisUnavailableError:
    return RedisUnavailableError(f"Redis at {redact_url(url)} {what}")


def refused(exc: object, url: str = "") -> RedisUnavailableError:
    """Credentials Redis refused (to the client of ``url``): one clear error, never ridden out."""
    at = f" at {redact_url(url)}" if url else ""
    return RedisUnavailableError(
        f"Redis{at} refused the credentials: {exc} (check the password in TOKENMILL_REDIS_URL)"
    )


class ServerStartError(TokenmillError):
    """A managed inference server did not become ready; the message carries its last error."""


class ResultStoreError(TokenmillError):
    """The result store cannot be reached, written or read; the message names the URL or file."""


class ShardLostError(ResultStoreError):
    """Sealed shards are missing or unreadable: each is named with the jobs it held."""

    def __init__(self, run: str, lost: dict[str, tuple[str, list[str]]]) -> None:
        lines = [f"run {run}: {len(lost)} sealed shard(s) cannot be read; their results are not exported:"]
        for shard_id, (why, job_ids) in sorted(lost.items()):
            shown = ", ".join(job_ids[:10]) + (f", … ({len(job_ids) - 10} more)" if len(job_ids) > 10 else "")
            lines.append(f"  shard {shard_id}: {why}; it held {len(job_ids)} job(s): {shown}")
        lines.append(
            f"Run `tokenmill repair --run {run}` to put those jobs back to queued and generate them again."
        )
        super().__init__("\n".join(lines))
        self.run = run
        self.lost = lost


class ExportError(TokenmillError):
    """A row cannot be written in the requested export format; the message names the job."""


class WaitTimeoutError(TokenmillError, TimeoutError):
    """``Client.wait`` gave up before the run ended; ``status`` is the last status it read."""

    def __init__(self, message: str, status: object) -> None:
        super().__init__(message)
        self.status = status


class RunBusyError(TokenmillError):
    """A run cannot be deleted while workers still hold its jobs."""


class StaleClaimError(TokenmillError):
    """The fencing token no longer matches: another worker owns the job now."""


# --- generation: the error taxonomy's classes ----------------------------------------------------


class GenerationError(TokenmillError):
    """A generation request failed. ``error_class`` is the stable name recorded in the ledger
    (a subclass names its own: ``class X(GenerationError, error_class="x")``)."""

    error_class = "error"

    def __init_subclass__(cls, error_class: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.error_class = error_class

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class TerminalError(GenerationError, error_class="terminal"):
    """Retrying cannot help: the job ends ``failed`` with this class and the server's message."""


class ContextLengthError(TerminalError, error_class="context_length"): ...


class InvalidRequestError(TerminalError, error_class="invalid_request"): ...


class UnsupportedOptionError(TerminalError, error_class="unsupported_option"):
    """The server does not serve a request option the job asked for (e.g. too old a version)."""


class AuthError(TerminalError, error_class="auth"):
    """The server refused our API key. Workers stop claiming instead of failing every job."""


class RetryableError(GenerationError, error_class="retryable"):
    """A passing fault: the job goes back to ``queued`` with a backoff."""


class ServerConnectionError(RetryableError, error_class="connection"): ...


class ServerUnavailableError(RetryableError, error_class="server_unavailable"):
    """A 5xx, or a 503 queue-full abort."""


class StreamStalledError(RetryableError, error_class="stall"): ...


class StreamLostError(RetryableError, error_class="stream_lost"):
    """The server answers but no longer holds the stream's request (restarted, or a replacement
    answers where its host vanished): the stream is abandoned and the job continues."""


class StreamError(RetryableError, error_class="stream_error"):
    """An error chunk arrived mid-stream, or the stream ended without a finish."""


class IncompleteOutputError(RetryableError, error_class="incomplete_output"):
    """The stream ended, but the per-token data it was asked for does not cover every token."""


class RequestTimeoutError(RetryableError, error_class="timeout"): ...


class ShutdownError(RetryableError, error_class="shutdown"):
    """The worker is shutting down: the job is checkpointed and released."""


class JobCancelledError(GenerationError, error_class="cancelled"):
    """``tokenmill cancel --now`` stopped the stream: the job ends ``cancelled``, checkpointed."""
