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
(one at a time, packed padding-free), never on the event loop. This module imports no
torch until a reward model is loaded: ``python -m astrai.serve`` checks its options first.
"""

from __future__ import annotations

import asyncio
import logging
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
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.max_batch_tokens = max_batch_tokens
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

    def score(self, sequences: list[list[int]]) -> list[float]:
        """Rewards in packs of ``max_batch_tokens`` (None: ``score_sequences``' default)."""
        from astrai.model.reward import score_sequences

        if self.max_batch_tokens is None:
            return score_sequences(self.model, sequences)
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


def pairs_of(body: ScoreRequest, max_chars: int | None) -> list[tuple[str, str]]:
    """``(prompt, completion)`` pairs of a request: one ``text_1`` goes with every
    ``text_2``, otherwise the lists pair up one to one."""
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
) -> dict[str, Any]:
    """The response body of one ``/v1/score`` request against ``scorer`` (an `APIError` on a
    bad one); ``run_blocking`` renders on the server's tokenizer pool."""
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
    pairs = pairs_of(body, settings.max_prompt_chars)
    sequences = await run_blocking(scorer.render, pairs)
    loop = asyncio.get_running_loop()
    scores = await loop.run_in_executor(scorer.executor, scorer.score, sequences)
    tokens = sum(len(s) for s in sequences)
    return {
        "id": "score-" + secrets.token_hex(12),
        "object": "list",
        "created": int(time.time()),
        "model": scorer.name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
