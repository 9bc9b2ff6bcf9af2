"""vLLM's ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` takes a completion's ``{"prompt": str}`` or a chat's ``{"messages": [...]}``
(with what a chat request may carry: ``tools``, ``chat_template_kwargs``,
``add_generation_prompt``, default true) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``. A chat is rendered and tokenized by the chat route's own
prepare step, so its ids are exactly the ones ``/v1/chat/completions`` submits (the
routers' prefix matching relies on it: docs/serving.md, "Data-parallel serving").
``add_special_tokens`` is vLLM's, defaults included: true for a prompt (the tokenizer's
post-processor runs, e.g. a Llama BOS; send false for the ids ``/v1/completions``
submits, which uses a prompt as given), false for messages, whose template writes the
special tokens itself (true there is a 400: they would be written twice).
``/detokenize`` takes ``{"tokens": [int]}`` and answers ``{"prompt": str}``, special
tokens included; an id outside the tokenizer's vocabulary is a 400 naming ``tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from astrai.serve.errors import APIError
from astrai.serve.handler import ProtocolHandler
from astrai.serve.schemas import ChatCompletionRequest, CompletionRequest
from astrai.serve.state import ServerState

# Tokenize-only fields, taken off the body before it is read as a chat or completion.
_OWN = ("add_special_tokens", "return_token_strs")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


def _tokenize_body(body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """vLLM's two request forms: ``messages`` (a chat, rendered by its template) or a text
    ``prompt``; `max_tokens` 1 so that no prompt is refused for the room it leaves."""
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    if kind is CompletionRequest and not isinstance(body.get("prompt"), str):
        raise APIError(400, "prompt: a string is required (or messages, a chat)", param="prompt")
    fields = {k: v for k, v in body.items() if k not in _OWN}
    try:
        return kind.model_validate({**fields, "max_tokens": 1, "stream": False})
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ())) or "body"
        raise APIError(400, f"{field}: {first.get('msg')}", param=field) from None


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(400, f"{name}: expected a boolean, got {value!r}", param=name)
    return value


def install_tokenize_routes(
    app: FastAPI,
    state: ServerState,
    chat: ProtocolHandler,
    completions: ProtocolHandler,
    dependencies: Sequence[Depends],
) -> None:
    """Mount ``POST /tokenize`` and ``POST /detokenize`` on `app`, behind `dependencies`
    (the API key)."""
    tokenizer = state.engine.tokenizer

    @app.post("/tokenize", dependencies=list(dependencies))
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise APIError(400, "body: expected a JSON object", param="body")
        is_chat = "messages" in body
        special = _flag(body, "add_special_tokens", not is_chat)
        strs = _flag(body, "return_token_strs", False)
        if is_chat and special:
            raise APIError(
                400,
                "add_special_tokens: the chat template writes the special tokens of "
                "messages; only false is accepted with messages",
                param="add_special_tokens",
            )
        request = _tokenize_body(body)
        prepared = await (chat if is_chat else completions).prepare(request)
        tokens = [t for prompt in prepared.prompts for t in prompt]
        if special:  # a text prompt through the tokenizer's post-processor (vLLM's default)
            tokens = tokenizer.encode(body["prompt"], add_special_tokens=True)
        return {
            "count": len(tokens),
            "max_model_len": state.engine.max_seq_len,
            "tokens": tokens,
            "token_strs": [tokenizer.decode([t]) for t in tokens] if strs else None,
        }

    @app.post("/detokenize", dependencies=list(dependencies))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.models.resolve(body)  # an unknown model: 404, as every route answers
        vocab = len(tokenizer)
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"tokens: [{bad}] = {body.tokens[bad]} is not a token id "
                f"(the vocabulary is 0..{vocab - 1})",
                param="tokens",
            )
        return {"prompt": tokenizer.decode(body.tokens)}
