"""The error a request gets when SGLang would refuse it."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """A request SGLang would refuse: ``status``, error ``type`` and the exact ``message``."""

    def __init__(self, message: str, *, status: int = 400, type_: str = "BadRequestError"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {
            "object": "error",
            "message": self.message,
            "type": self.type,
            "param": None,
            "code": self.status,
        }
