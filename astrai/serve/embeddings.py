"""``POST /v1/embeddings`` (OpenAI's shape): pooled, L2-normalised final hidden states
(`astrai.inference.embedding`, pooled as the `pooling_type` setting says), from the served
model or from a separate embedding export (`embedding_model=<dir>`).

Request ``{"input": str | [str] | [int] | [[int]], "model", "encoding_format": "float" |
"base64", "dimensions"}``; `dimensions` is a 400 (the model's width is the only one).
`model` picks the embedder (`embedder_for`): with an embedding export, its name (or no
`model`) embeds with it, the served model's name with the served model, any other name is
vLLM's 404; without one, names are checked as the generation routes check them
(`ServedModels.resolve`). Response ``{"object": "list", "data": [{"object": "embedding",
"index", "embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``; `base64` is
the little-endian float32 bytes the `openai` SDK decodes. Every input is checked (empty,
token ids out of the embedder's vocabulary, longer than its context: a 400 naming `input`)
before any forward runs; the forwards run off the event loop.
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


def embedder_for(
    body: EmbeddingRequest, state: ServerState, served: Embedder, export: Embedder | None
) -> Embedder:
    """The embedder a request's `model` names (see the module's docstring); a 404 naming
    `model` for a name this server does not embed with."""
    if export is None:
        adapter = state.models.resolve(body)  # a 404 for an unknown name, as elsewhere
        if adapter is not None:
            raise APIError(
                400,
                f"model: {adapter!r} is a LoRA adapter; embeddings come from the base model "
                f"({served.name}) only",
                param="model",
            )
        return served
    name = body.model
    if name is None or name == export.name:
        return export
    if name == served.name:
        return served
    raise APIError(
        404,
        f"The model `{name}` does not exist; the embedding models are `{export.name}` and "
        f"`{served.name}`.",
        kind="not_found",
        param="model",
        code="model_not_found",
    )


def _token_lists(
    body: EmbeddingRequest, embedder: Embedder, max_chars: int | None
) -> list[list[int]]:
    """Each input as `embedder`'s token ids (texts encoded without a chat template, as
    vLLM embeds); a 400 naming `input` for an empty, out-of-vocabulary or over-long one."""
    check_unicode(body)
    raw = body.input
    if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
        raw = [raw]
    if not raw:
        raise APIError(400, "input: an empty list", param="input")
    limit, vocab = embedder.max_seq_len, embedder.vocab_size
    prompts = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if max_chars is not None and len(item) > max_chars:
                raise APIError(
                    400,
                    f"input[{i}]: {len(item)} characters, over max_prompt_chars ({max_chars})",
                    param="input",
                )
            ids = embedder.encode(item)
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400,
                    f"input[{i}]: token id {bad[0]} outside the vocabulary (0..{vocab - 1})",
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
    app: FastAPI,
    state: ServerState,
    served: Embedder,
    dependencies: Sequence[Depends],
    export: Embedder | None = None,
) -> None:
    """Mount ``POST /v1/embeddings`` behind `dependencies` (the API key): `served` embeds
    with the served model, `export` (if any) is the separate embedding export."""

    @app.post("/v1/embeddings", dependencies=list(dependencies))
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        if body.dimensions is not None:
            raise APIError(
                400,
                "dimensions: not supported (embeddings have the model's hidden size)",
                param="dimensions",
            )
        embedder = embedder_for(body, state, served, export)
        state.check_ready()
        max_chars = state.settings.max_prompt_chars
        prompts = await state.run_blocking(_token_lists, body, embedder, max_chars)
        vectors = await state.run_blocking(embedder.embed, prompts)
        tokens = sum(len(p) for p in prompts)
        return {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "model": embedder.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
