"""Errors as OpenAI's API returns them: a status and `{"error": {"message", "type", "param",
"code"}}`. Every failure a request can meet becomes one of these, never a crash."""

from __future__ import annotations

import math
from typing import Any


class APIError(Exception):
    """A request that fails with `status`; `param` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=param, code=code)


def is_finite_number(value: Any) -> bool:
    """A JSON number that is no bool, NaN nor infinity. An integer of any size is one (JSON
    allows 400 digits): compare it before any float() of it, which would overflow."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)


def shutting_down() -> APIError:
    """The 503 of a request that the server's shutdown refuses or ends."""
    return APIError(
        503,
        "the server is shutting down",
        type="server_error",
        code="shutting_down",
        headers={"Retry-After": "1"},
    )
