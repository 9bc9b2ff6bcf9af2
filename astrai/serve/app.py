"""`create_app(engine, settings)`: the FastAPI application."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from astrai.inference.embedding import Embedder
from astrai.inference.grammar import grammar_compiler
from astrai.serve.access import AccessLogMiddleware
from astrai.serve.adapters import RUNTIME_LORA_OFF, RUNTIME_LORA_PATHS, install_runtime_lora
from astrai.serve.anthropic_builder import AnthropicResponseBuilder
from astrai.serve.completions_builder import CompletionsResponseBuilder
from astrai.serve.embeddings import install_embedding_routes
from astrai.serve.errors import APIError, error_body, kind_for_status
from astrai.serve.handler import ProtocolHandler
from astrai.serve.limits import BodyLimitMiddleware
from astrai.serve.metrics import HTTPMetrics
from astrai.serve.openai_builder import OpenAIResponseBuilder
from astrai.serve.openapi import install_openapi
from astrai.serve.protocol import SafeJSONResponse
from astrai.serve.responses_builder import ResponsesBuilder
from astrai.serve.responses_request import ResponsesRequest
from astrai.serve.responses_store import ResponseStore
from astrai.serve.rl_routes import install_rl_routes
from astrai.serve.router_compat import install_router_compat
from astrai.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    MessagesRequest,
)
from astrai.serve.score import RewardScorer, ScoreRequest, score_request
from astrai.serve.settings import ServeSettings
from astrai.serve.state import ServerState
from astrai.serve.tokenize_routes import install_tokenize_routes

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine

logger = logging.getLogger("astrai.serve")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First few pydantic errors as 'field: message', and the first field's dotted path."""
    parts, param = [], None
    for err in exc.errors()[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"invalid JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        field = ".".join(loc) or "body"
        param = param or field
        parts.append(f"{field}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def _error_response(request: Request, err: APIError) -> SafeJSONResponse:
    return SafeJSONResponse(
        error_body(request.url.path, err), status_code=err.status, headers=err.headers
    )


def create_app(
    engine: InferenceEngine,
    settings: ServeSettings | None = None,
    reward: RewardScorer | None = None,
    fingerprint: Callable[[], str | None] | None = None,
    embedding: Embedder | None = None,
) -> FastAPI:
    """An app serving `engine`; the caller owns the engine (and shuts it down).

    `app.state.astrai` is the `ServerState`; `begin_shutdown()` on it ends open streams
    cleanly (the `astrai.serve.server.Server` calls it when uvicorn is asked to stop).
    `reward`: a loaded reward model for `POST /v1/score` (`astrai.serve.score`); without
    one that route answers a 400 saying how to load one. `fingerprint`: called once per
    request, at submission; its string is the `system_fingerprint` of OpenAI responses and
    chunks (None, or no callable: the field is left out). The LoRA load / unload routes
    are mounted only with `settings.allow_runtime_lora` (`astrai.serve.adapters`).
    `embedding`: a separate embedding export (`Embedder.from_pretrained`) that
    `/v1/embeddings` answers with under its own name; the served model embeds too, under
    its name (`astrai.serve.embeddings`).
    """
    settings = settings or ServeSettings()
    warm_up_structured_outputs(engine)
    state = ServerState(
        engine, settings, reward=reward, fingerprint=fingerprint, embedding=embedding
    )
    app = FastAPI(title="astrai", version="1", docs_url=None, redoc_url=None)
    app.state.astrai = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    # Outermost (added last): request ids, the access log and request metrics see every
    # response, the body limit's 413s included.
    metrics = HTTPMetrics(engine)
    app.state.metrics = metrics
    app.add_middleware(AccessLogMiddleware, metrics=metrics)
    install_openapi(app)
    openai = ProtocolHandler(state, OpenAIResponseBuilder())
    anthropic = ProtocolHandler(state, AnthropicResponseBuilder())
    completions = ProtocolHandler(state, CompletionsResponseBuilder())
    responses = ProtocolHandler(
        state, ResponsesBuilder(ResponseStore(settings.max_stored_responses))
    )

    async def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if given is None and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), settings.api_key.encode()):
            raise APIError(
                401, "invalid or missing API key", kind="authentication", code="invalid_api_key"
            )

    auth = [Depends(check_key)]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> SafeJSONResponse:
        if exc.status >= 500:
            logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc)
        return _error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> SafeJSONResponse:
        message, param = _validation_message(exc)
        return _error_response(request, APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> SafeJSONResponse:
        unmounted = exc.status_code == 404 and request.url.path in RUNTIME_LORA_PATHS
        err = APIError(
            exc.status_code,
            RUNTIME_LORA_OFF if unmounted else str(exc.detail),
            kind=kind_for_status(exc.status_code),
            headers=dict(exc.headers or {}),  # e.g. Allow on a 405
        )
        return _error_response(request, err)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> SafeJSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        # This handler runs outside the access-log middleware: it adds the request id.
        rid = getattr(request.state, "request_id", None)
        headers = {"x-request-id": rid} if rid else None
        err = APIError(500, "internal server error", kind="server", headers=headers)
        return _error_response(request, err)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await openai.handle(body, request)

    @app.post("/v1/completions", dependencies=auth)
    async def text_completions(body: CompletionRequest, request: Request) -> Response:
        return await completions.handle(body, request)

    @app.post("/v1/responses", dependencies=auth)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await responses.handle(body, request)

    @app.post("/v1/messages", dependencies=auth)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await anthropic.handle(body, request)

    @app.post("/v1/messages/count_tokens", dependencies=auth)
    async def count_tokens(body: CountTokensRequest) -> dict:
        return {"input_tokens": await anthropic.count_tokens(body.as_messages_request())}

    @app.post(
        "/v1/score",
        dependencies=auth,
        responses={404: {"description": "Unknown model (not the loaded reward model)"}},
    )
    async def score(body: ScoreRequest, request: Request) -> dict:
        return await score_request(
            state.reward,
            body,
            draining=state.draining,
            settings=state.settings,
            run_blocking=state.run_blocking,
            disconnected=request.is_disconnected,
        )

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict:
        return {"object": "list", "data": state.models.cards()}

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> dict:
        return state.models.card(model_id)

    install_router_compat(app, state)  # what routers ask workers
    install_tokenize_routes(app, state, openai, completions, auth)  # vLLM's (de)tokenize
    if settings.allow_runtime_lora:  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
        install_runtime_lora(app, state.models, settings.allowed_lora_roots, [check_key])

    install_rl_routes(app, state, check_key)  # /generate, weight updates (opt-in)
    served = Embedder.of_engine(engine, settings.pooling_type, settings.model_name)
    install_embedding_routes(app, state, served, auth, embedding)

    @app.get("/health")
    async def health() -> SafeJSONResponse:
        ok = engine.ready and not state.draining
        body = {"status": "ok" if ok else "unavailable", "model_loaded": engine.ready}
        headers = {} if ok else {"retry-after": str(settings.retry_after_s)}
        return SafeJSONResponse(body, status_code=200 if ok else 503, headers=headers)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        # Open like /health (as in vLLM): scrapers rarely hold API keys; it shows counts
        # and latencies, never request content.
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/stats", dependencies=auth)
    async def stats() -> dict:
        return {**engine.get_stats(), **state.stats()}

    return app


def warm_up_structured_outputs(engine: InferenceEngine) -> None:
    """Build llguidance's view of the tokenizer now, at start-up: built by the first
    structured-output request instead, it takes seconds for a large vocabulary and holds
    up every request around it. A tokenizer llguidance cannot read is logged, not fatal:
    only structured requests need it."""
    try:
        grammar_compiler(engine.tokenizer).warm_up()
    except Exception as err:  # llguidance's own errors: a plain server still serves
        logger.warning("structured outputs will not work with this tokenizer: %s", err)
