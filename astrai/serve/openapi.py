"""The OpenAPI document, describing the errors the server really answers.

FastAPI documents a 422 for every body it validates; this server answers 400 instead
(see `create_app`), plus the statuses of its own checks. `install_openapi` rewrites each
operation's responses accordingly, with the protocol's error body as the schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_DESCRIPTIONS = {
    "400": "Invalid request (the error names the field)",
    "401": "Invalid or missing API key",
    "404": "Unknown model (or LoRA adapter)",
    "413": "Request body over the configured limit",
    "500": "Internal error",
    "503": "Not ready, shutting down, or the request queue is full (retry-after)",
    "504": "The request ran past its timeout",
}
_POST = ("400", "401", "404", "413", "500", "503")
_LORA = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _errors(path: str, method: str) -> list[str]:
    if method != "post":
        return ["401", "404"] if "{" in path else ["401"]
    if path in _LORA:  # 404: unload of an adapter that is not loaded
        return ["400", "401", "404", "413", "500"]
    if path.endswith("/count_tokens"):
        return list(_POST)
    return [*_POST, "504"]


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document with 422 replaced by the error statuses this server returns."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["OpenAIError"] = _OPENAI_ERROR
    schemas["AnthropicError"] = _ANTHROPIC_ERROR
    for path, ops in doc.get("paths", {}).items():
        shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path == "/health":
                continue
            for status in _errors(path, method):
                responses[status] = {
                    "description": _DESCRIPTIONS[status],
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}
                    },
                }
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve `build_openapi(app)` (built once, on first request) at /openapi.json."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if "doc" not in cache:
            cache["doc"] = build_openapi(app)
        app.openapi_schema = cache["doc"]
        return cache["doc"]

    app.openapi = openapi  # type: ignore[method-assign]
