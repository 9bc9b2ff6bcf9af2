"""What the existing routers ask a worker for, beyond the OpenAI routes (docs/serving.md,
"Data-parallel serving"), under the names of the servers they were written for:

- vLLM's ``POST /tokenize``: `vllm-router`'s cache-aware policy asks every worker for a
  request's prompt tokens (a completion's ``prompt`` or a chat's ``messages``) and matches
  prefixes on tokens; without it the router falls back to its text tree. The ids are
  exactly the ones the request would be submitted with (the protocol handler's own
  rendering and tokenizing), ``{"count", "max_model_len", "tokens", "token_strs"}``.
- SGLang's ``GET /get_server_info`` (and ``/server_info``): `sglang-router` registers a
  worker under the model it reports there (``served_model_name`` / ``model_path``); without
  it every worker is "unknown" and the router's ``/v1/models`` says so. It reads SGLang's
  ``/get_model_info`` (``/model_info``) next, answered here too. Both name the served model
  (never a directory: the server's file system is not the clients' business).

Each answers as its reference does; a bad body is the usual 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends
from pydantic import ValidationError

from astrai.serve.errors import APIError
from astrai.serve.handler import ProtocolHandler
from astrai.serve.schemas import ChatCompletionRequest, CompletionRequest
from astrai.serve.state import ServerState


def _tokenize_body(body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """vLLM's two request forms: ``messages`` (a chat, rendered by its template) or
    ``prompt``; `max_tokens` 1 so that no prompt is refused for the room it leaves."""
    if not isinstance(body, dict):
        raise APIError(400, "body: expected a JSON object", param="body")
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    if kind is CompletionRequest and "prompt" not in body:
        raise APIError(400, "prompt: one of prompt or messages is required", param="prompt")
    try:
        return kind.model_validate({**body, "max_tokens": 1, "stream": False})
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise APIError(400, f"{field}: {first.get('msg')}", param=field) from None


def install_router_compat(
    app: FastAPI,
    state: ServerState,
    chat: ProtocolHandler,
    completions: ProtocolHandler,
    dependencies: Sequence[Depends],
) -> None:
    """Mount ``POST /tokenize`` (behind `dependencies`: the API key) and the open
    ``GET /get_server_info``, ``/get_model_info`` (and their short names) on `app`."""
    tokenizer = state.engine.tokenizer

    @app.post("/tokenize", dependencies=list(dependencies))
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        request = _tokenize_body(body)
        handler = chat if isinstance(request, ChatCompletionRequest) else completions
        prepared = await handler.prepare(request)
        tokens = [t for prompt in prepared.prompts for t in prompt]
        strs = [tokenizer.decode([t]) for t in tokens] if body.get("return_token_strs") else None
        return {
            "count": len(tokens),
            "max_model_len": state.engine.max_seq_len,
            "tokens": tokens,
            "token_strs": strs,
        }

    def model_info() -> dict[str, Any]:
        name = state.settings.model_name
        return {"model_path": name, "tokenizer_path": name, "is_generation": True}

    def server_info() -> dict[str, Any]:
        name = state.settings.model_name
        return {
            "model_path": name,
            "served_model_name": name,
            "tokenizer_path": name,
            "context_length": state.engine.max_seq_len,
        }

    for path, route in (("model_info", model_info), ("server_info", server_info)):
        app.get(f"/get_{path}")(route)
        app.get(f"/{path}")(route)
