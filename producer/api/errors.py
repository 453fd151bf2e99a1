"""The API's errors, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

SERVER_ERROR = 500  # from this status on, type server_error; below, invalid_request_error


class ApiError(Exception):
    """An answer other than success: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= SERVER_ERROR else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400: the request is wrong, ``param`` names what."""
    return ApiError(400, message, param, code)


def not_found(what: str, ident: str, param: str | None = None) -> ApiError:
    """A 404 naming the object that is not there."""
    return ApiError(404, f"No such {what}: {ident!r}", param, "not_found")
