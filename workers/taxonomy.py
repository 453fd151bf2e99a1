"""The error taxonomy: the one place a server's answer becomes a tokenmill error class.

Terminal (retrying cannot help): context length exceeded, invalid request, auth.
Retryable (a passing fault): connection errors, timeouts, 5xx, 503 queue-full, stalls,
mid-stream error chunks, aborted or unfinished streams.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenmill import errors

_CONTEXT_MARKERS = (
    "context length",
    "maximum context length",
    "Requested token count exceeds",
    "exceeds the maximum allowed length",
)


def from_status(status: int, message: str) -> errors.GenerationError:
    """Classify an HTTP error status (or an error chunk's ``code``) and its message."""
    if status in (401, 403):
        return errors.AuthError(message, status=status)
    if status == 400 and any(m in message for m in _CONTEXT_MARKERS):
        return errors.ContextLengthError(message, status=status)
    if status in (400, 422):
        return errors.InvalidRequestError(message, status=status)
    if status == 404:
        return errors.ServerUnavailableError(
            f"HTTP 404 from the server: is it an SGLang (OpenAI-compatible) server? {message}",
            status=status,
        )
    return errors.ServerUnavailableError(f"HTTP {status}: {message}", status=status)


def from_answer(status: int, body: bytes) -> errors.GenerationError:
    """Classify an error answer: its status and the message its body carries, read as the openai
    client reads it (a JSON body's ``error``, unwrapped: SGLang's 401 ``{"error":
    "Unauthorized"}`` is the string itself, its OpenAI envelope the envelope's ``message``)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        parsed: Any = orjson.loads(text)
    except orjson.JSONDecodeError:
        parsed = text
    if isinstance(parsed, dict):
        parsed = parsed.get("error", parsed)
    return from_status(status, _message(parsed) or f"Error code: {status}" + (f" - {text}" if text else ""))


def from_error_chunk(payload: dict[str, Any]) -> errors.GenerationError:
    """Classify an SSE ``{"error": {...}}`` chunk received mid-stream."""
    err = payload.get("error")
    if isinstance(err, dict):
        message = str(err.get("message") or err)
        code = err.get("code")
    else:
        message, code = str(err), None
    if code == 400 and any(m in message for m in _CONTEXT_MARKERS):
        return errors.ContextLengthError(message, status=400)
    return errors.StreamError(f"error chunk mid-stream (code {code}): {message}", status=code)


def from_exception(exc: BaseException) -> errors.GenerationError:
    """Classify a client-side exception raised while requesting or streaming (not a GenerationError)."""
    if isinstance(exc, TimeoutError):  # (asyncio's since Python 3.11)
        return errors.RequestTimeoutError(f"request timed out: {exc}")
    if isinstance(exc, OSError):  # refused, reset, closed mid-answer, unresolvable, TLS
        return errors.ServerConnectionError(f"connection to the server failed: {exc}")
    return errors.StreamError(f"{type(exc).__name__}: {exc}")


def _message(body: Any) -> str:
    if isinstance(body, str):
        return body
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            return str(body["error"].get("message") or body)
        if "message" in body:
            return str(body["message"])
        if "error" in body:
            return str(body["error"])
    return ""
