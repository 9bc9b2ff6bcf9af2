"""``POST /v1/embeddings`` (OpenAI's shape): the served model's pooled, L2-normalised final
hidden states (`astrai.inference.embedding`, pooled as the `pooling_type` setting says).

Request ``{"input": str | [str] | [int] | [[int]], "model", "encoding_format": "float" |
"base64", "dimensions"}``; `dimensions` is a 400 (the model's width is the only one).
Response ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
"model", "usage": {"prompt_tokens", "total_tokens"}}``; `base64` is the little-endian float32
bytes the `openai` SDK decodes. Every input is checked (empty, token ids out of the
vocabulary, longer than the context: a 400 naming `input`) before any forward runs; the
forward runs off the event loop.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Depends, FastAPI
from pydantic import BaseModel, ConfigDict

from astrai.serve.errors import APIError
from astrai.serve.limits import check_unicode

if TYPE_CHECKING:
    from astrai.inference.embedding import Embedder
    from astrai.serve.state import ServerState


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _token_lists(body: EmbeddingRequest, state: ServerState) -> list[list[int]]:
    """Each input as token ids (texts encoded without a chat template, as vLLM embeds);
    a 400 naming `input` for an empty, out-of-vocabulary or over-long one."""
    check_unicode(body)
    raw = body.input
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    if not raw:
        raise APIError(400, "input: an empty list", param="input")
    engine, limit = state.engine, state.engine.max_seq_len
    prompts = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if len(item) > state.settings.max_prompt_chars:
                raise APIError(
                    400,
                    f"input[{i}]: {len(item)} characters, over max_prompt_chars "
                    f"({state.settings.max_prompt_chars})",
                    param="input",
                )
            ids = engine.encode(item)
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < engine.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"input[{i}]: token id {bad[0]} outside the vocabulary "
                    f"(0..{engine.vocab_size - 1})",
                    param="input",
                )
        if not ids:
            raise APIError(400, f"input[{i}]: no tokens to embed", param="input")
        if len(ids) > limit:
            raise APIError(
                400,
                f"input[{i}]: {len(ids)} tokens, over the model's context length ({limit})",
                param="input",
                code="context_length_exceeded",
            )
        prompts.append(ids)
    return prompts


def _encoded(vector: Any, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def install_embedding_routes(
    app: FastAPI, state: ServerState, embedder: Embedder, dependencies: Sequence[Depends]
) -> None:
    """Mount ``POST /v1/embeddings`` behind `dependencies` (the API key)."""

    @app.post("/v1/embeddings", dependencies=list(dependencies))
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        if body.dimensions is not None:
            raise APIError(
                400,
                "dimensions: not supported (embeddings have the model's hidden size)",
                param="dimensions",
            )
        state.check_ready()
        prompts = await state.run_blocking(_token_lists, body, state)
        vectors = await state.run_blocking(embedder.embed, prompts)
        tokens = sum(len(p) for p in prompts)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "model": state.settings.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
