"""What every protocol's handler shares: admission, the requests in flight, counters, the
tokenizer pool, and shutdown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from astrai.serve.adapters import ServedModels
from astrai.serve.errors import APIError
from astrai.serve.protocol import RequestContext
from astrai.serve.reasoning import check_harmony_parsers, resolve_reasoning_parser
from astrai.serve.settings import ServeSettings
from astrai.serve.tool_parsers import resolve as resolve_tool_parser

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.inference.embedding import Embedder
    from astrai.serve.score import RewardScorer


class ServerState:
    """What the handlers share: admission, requests in flight, counters, shutdown."""

    def __init__(
        self,
        engine: InferenceEngine,
        settings: ServeSettings,
        reward: RewardScorer | None = None,
        fingerprint: Callable[[], str | None] | None = None,
        embedding: Embedder | None = None,
    ) -> None:
        self.engine = engine
        # Each request's `system_fingerprint`, read when it is submitted (None: none sent);
        # astrai.train.serve_policy names the live policy's version with it.
        self.fingerprint: Callable[[], str | None] = fingerprint or (lambda: None)
        self.reward = reward  # POST /v1/score's reward model (astrai.serve.score), if loaded
        # /v1/embeddings' separate embedding export (astrai.serve.embeddings), if loaded
        self.embedding = embedding
        self.settings = settings
        # The format tool calls are parsed in (`tool_parser=auto`: the chat template's).
        self.tool_parser = resolve_tool_parser(
            settings.tool_parser, getattr(engine.tokenizer, "chat_template", None)
        )
        check_harmony_parsers(
            self.tool_parser.name if self.tool_parser is not None else None,
            resolve_reasoning_parser(settings.reasoning_parser, engine.tokenizer),
        )
        self.draining = False
        self.inflight: set[RequestContext] = set()
        self.requests_total = 0
        self.requests_failed = 0
        self.tokens_out = 0
        self.started = time.time()
        # The names requests may give as `model`: the base, the reward and embedding
        # models, the adapters.
        self.models = ServedModels(
            engine,
            settings.model_name,
            self.started,
            reward.name if reward else None,
            embedding.name if embedding else None,
        )
        # Prompt rendering and tokenizing run here, so a large prompt never blocks the
        # event loop (other streams, /health); `tokenizers` releases the GIL while encoding.
        self.executor = ThreadPoolExecutor(
            max_workers=max(1, settings.tokenizer_threads), thread_name_prefix="astrai-tokenize"
        )

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the tokenizer pool, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        """Stop the tokenizer pool and the scorer's thread (queued work is dropped)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.reward is not None:
            self.reward.close()

    def check_ready(self) -> None:
        retry = {"retry-after": str(self.settings.retry_after_s)}
        if self.draining:
            raise APIError(503, "server is shutting down", kind="overloaded", headers=retry)
        if not self.engine.ready:
            raise APIError(503, "engine not ready", kind="overloaded", headers=retry)
        if self.engine.queue_full:
            raise APIError(
                503, "request queue is full, retry later", kind="overloaded", headers=retry
            )

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every open one (streams finish cleanly)."""
        self.draining = True
        self.cancel_all()

    def cancel_all(self) -> None:
        """End every open request: its engine tasks are cancelled, its stream finishes."""
        for ctx in list(self.inflight):
            for c in ctx.choices:
                if not c.result.done:
                    self.engine.cancel(c.result)

    def stats(self) -> dict[str, Any]:
        """HTTP-side counts (latencies: the engine's `get_stats()`, and `/metrics`)."""
        return {
            "requests_total": self.requests_total,
            "requests_failed": self.requests_failed,
            "requests_in_flight": len(self.inflight),
            "output_tokens": self.tokens_out,
            "draining": self.draining,
        }
