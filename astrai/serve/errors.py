"""One exception for every failure a client should see, rendered per protocol."""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    "invalid_request", "authentication", "not_found", "too_large", "overloaded", "timeout", "server"
]

_OPENAI_TYPES: dict[str, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "too_large": "invalid_request_error",
    "overloaded": "service_unavailable_error",
    "timeout": "timeout_error",
    "server": "server_error",
}
_ANTHROPIC_TYPES: dict[str, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "overloaded": "overloaded_error",
    "timeout": "timeout_error",
    "server": "api_error",
}


class APIError(Exception):
    """An HTTP error with a protocol-neutral kind; `error_body` shapes it per protocol."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: ErrorKind = "invalid_request",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}


def kind_for_status(status: int) -> ErrorKind:
    if status in (401, 403):
        return "authentication"
    if status == 404:
        return "not_found"
    if status == 413:
        return "too_large"
    if status in (408, 504):
        return "timeout"
    if status in (429, 503):
        return "overloaded"
    return "server" if status >= 500 else "invalid_request"


def openai_error_body(err: APIError) -> dict:
    return {
        "error": {
            "message": err.message,
            "type": _OPENAI_TYPES[err.kind],
            "param": err.param,
            "code": err.code,
        }
    }


def anthropic_error_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES[err.kind], "message": err.message}}


def error_body(path: str, err: APIError) -> dict:
    """Anthropic's shape under /v1/messages, OpenAI's everywhere else."""
    if path.startswith("/v1/messages"):
        return anthropic_error_body(err)
    return openai_error_body(err)
