"""``POST /v1/score``: a reward model's score of completions (vLLM's score API shape).

Request ``{"model": str?, "text_1": str | [str], "text_2": str | [str]}``: ``text_1`` the
prompt(s), ``text_2`` the completion(s); one ``text_1`` with any number of ``text_2``, or
two lists of one length. Each pair is rendered with the reward model's chat template as its
training pairs were (`astrai.model.reward.render_for_reward`), and scored by a Bradley-Terry
reward model (``strategy=reward``'s export, or a transformers one-label
``*ForSequenceClassification``) that the server loads next to the generative model
(``python -m astrai.serve reward_model=<dir>``). Response ``{"id", "object": "list",
"created", "model", "data": [{"index", "object": "score", "score"}], "usage":
{"prompt_tokens", "total_tokens"}}``.

Rendering runs on the server's tokenizer pool and the forward on the scorer's own thread
(one at a time, packed padding-free), never on the event loop. A request holds at most
``max_client_batch_size`` pairs (TEI's name; more is a 400 naming the field, before any
work). Its pairs are scored in chunks, one forward of at most the scorer's
``max_batch_tokens`` each, submitted one at a time: between two chunks the request stops
when its client has gone or ``request_timeout_s`` has passed (a 504), and the chunks of
concurrent requests take turns on the scorer's thread, so an abandoned or a long job delays
another by at most one chunk. This module imports no torch until a reward model is
loaded: ``python -m astrai.serve`` checks its options first.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from astrai.serve.errors import APIError
from astrai.serve.limits import check_unicode

if TYPE_CHECKING:
    from astrai.serve.settings import ServeSettings

logger = logging.getLogger("astrai.serve")

HOW_TO_LOAD = (
    "start the server with reward_model=<dir> (a reward-model export: python -m astrai.train "
    "strategy=reward ..., or a transformers *ForSequenceClassification directory)"
)


class ScoreRequest(BaseModel):
    """vLLM's score request; the texts are checked by `pairs_of` (400 naming the item)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: Any = None
    text_2: Any = None


class RewardScorer:
    """A loaded reward model with its tokenizer and served name; forwards run one at a
    time on a dedicated thread."""

    def __init__(
        self, model: Any, tokenizer: Any, name: str, max_batch_tokens: int | None = None
    ) -> None:
        from astrai.model.reward import DEFAULT_MAX_BATCH_TOKENS

        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        # Tokens per forward (None: `score_sequences`' default): the size of one chunk.
        self.max_batch_tokens = max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        self.max_tokens = int(model.config.max_position_embeddings)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="astrai-score")

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: Any = None,
        name: str | None = None,
        max_batch_tokens: int | None = None,
    ) -> RewardScorer:
        """Load ``path`` (refused first when it has no ``score.weight``) and its tokenizer."""
        from astrai.model.reward import load_reward_model
        from astrai.tokenizer import AutoTokenizer

        path = Path(path).expanduser()
        model = load_reward_model(path, device=device, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer, name or path.resolve().name, max_batch_tokens)

    def render(self, pairs: list[tuple[str, str]]) -> list[list[int]]:
        """Token ids of every pair; a pair longer than the model's context is a 400."""
        from astrai.model.reward import render_for_reward

        out = []
        for i, (prompt, completion) in enumerate(pairs):
            ids = render_for_reward(self.tokenizer, prompt, completion)
            if len(ids) > self.max_tokens:
                raise APIError(
                    400,
                    f"text_2[{i}]: the pair renders to {len(ids)} tokens, more than the reward "
                    f"model's context of {self.max_tokens}",
                    param="text_2",
                    code="context_length_exceeded",
                )
            out.append(ids)
        return out

    def chunks(self, sequences: list[list[int]]) -> list[list[int]]:
        """Indices of `sequences` in the order they are scored, one forward's worth each."""
        from astrai.model.reward import pack_sequences

        return pack_sequences([len(s) for s in sequences], self.max_batch_tokens)

    def score(self, sequences: list[list[int]]) -> list[float]:
        """Rewards in packs of ``max_batch_tokens`` (a `chunks` entry is one pack)."""
        from astrai.model.reward import score_sequences

        return score_sequences(self.model, sequences, self.max_batch_tokens)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def _texts(value: Any, field: str, limit: int | None) -> list[str]:
    if value is None:
        raise APIError(400, f"{field}: required (a string or a list of strings)", param=field)
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise APIError(
            400,
            f"{field}: must be a string or a list of strings, got {type(value).__name__}",
            param=field,
        )
    if not items:
        raise APIError(400, f"{field}: must not be empty", param=field)
    for i, text in enumerate(items):
        where = field if isinstance(value, str) else f"{field}[{i}]"
        if not isinstance(text, str):
            raise APIError(
                400, f"{where}: must be a string, got {type(text).__name__}", param=field
            )
        if limit is not None and len(text) > limit:
            raise APIError(
                400,
                f"{where}: too long: {len(text)} characters, the limit is {limit}",
                param=field,
                code="context_length_exceeded",
            )
    return items


def pairs_of(body: ScoreRequest, max_chars: int | None, max_pairs: int) -> list[tuple[str, str]]:
    """``(prompt, completion)`` pairs of a request: one ``text_1`` goes with every
    ``text_2``, otherwise the lists pair up one to one; at most `max_pairs` of them."""
    for field, value in (("text_1", body.text_1), ("text_2", body.text_2)):
        if isinstance(value, list) and len(value) > max_pairs:
            raise APIError(
                400,
                f"{field}: {len(value)} items, but one request may score at most {max_pairs} "
                "pairs (the server's max_client_batch_size); split it into several requests",
                param=field,
                code="too_many_pairs",
            )
    check_unicode(body)
    prompts = _texts(body.text_1, "text_1", max_chars)
    completions = _texts(body.text_2, "text_2", max_chars)
    if len(prompts) == 1:
        prompts = prompts * len(completions)
    if len(prompts) != len(completions):
        raise APIError(
            400,
            f"text_2: {len(completions)} items for {len(prompts)} text_1 items; give one "
            "text_1 or as many as text_2",
            param="text_2",
        )
    return list(zip(prompts, completions))


async def score_request(
    scorer: RewardScorer | None,
    body: ScoreRequest,
    *,
    draining: bool,
    settings: ServeSettings,
    run_blocking: Callable[..., Awaitable[Any]],
    disconnected: Callable[[], Awaitable[bool]],
) -> dict[str, Any]:
    """The response body of one ``/v1/score`` request against ``scorer`` (an `APIError` on a
    bad one); ``run_blocking`` renders on the server's tokenizer pool; ``disconnected``
    tells whether the client has gone (asked between chunks)."""
    if scorer is None:
        raise APIError(
            400,
            f"no reward model is loaded, so /v1/score cannot score: {HOW_TO_LOAD}",
            code="reward_model_not_loaded",
        )
    if body.model is not None and body.model != scorer.name:
        raise APIError(
            404,
            f"The model {body.model!r} does not exist; the reward model is {scorer.name!r}",
            kind="not_found",
            param="model",
            code="model_not_found",
        )
    if draining:
        retry = {"retry-after": str(settings.retry_after_s)}
        raise APIError(503, "server is shutting down", kind="overloaded", headers=retry)
    timeout = settings.request_timeout_s
    deadline = time.monotonic() + (math.inf if timeout is None else timeout)
    pairs = pairs_of(body, settings.max_prompt_chars, settings.max_client_batch_size)
    sequences = await run_blocking(scorer.render, pairs)
    scores = [0.0] * len(sequences)
    loop = asyncio.get_running_loop()
    for done, chunk in enumerate(scorer.chunks(sequences)):
        if await disconnected():
            logger.info("score request: client gone, stopped after %d chunk(s)", done)
            raise APIError(499, "client disconnected", code="client_closed_request")
        if time.monotonic() >= deadline:
            logger.warning("score request: timed out after %ss, %d chunk(s) done", timeout, done)
            raise APIError(
                504, f"request timed out after {timeout} s", kind="timeout", code="timeout"
            )
        part = [sequences[i] for i in chunk]
        values = await loop.run_in_executor(scorer.executor, scorer.score, part)
        for i, value in zip(chunk, values):
            scores[i] = value
    tokens = sum(len(s) for s in sequences)
    return {
        "id": "score-" + secrets.token_hex(12),
        "object": "list",
        "created": int(time.time()),
        "model": scorer.name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
