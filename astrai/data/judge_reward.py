"""An LLM judge as a reward: a rubric prompt (the record's fields and the completion) sent to
any OpenAI-compatible ``/v1/chat/completions`` (``python -m astrai.serve`` included), the
verdict constrained by a ``response_format`` of type ``json_schema`` (an object with an
integer ``score`` in ``[min_score, max_score]``) and parsed from that JSON; a fixed ``seed``
and ``temperature`` make the verdict replay on a seeded server. An unparseable or
out-of-range verdict, or a failed request, is the reward's failure (its ``failure_value``).

    strategy.rewards:
      - {_target_: astrai.data.judge_reward.JudgeReward, url: "http://judge:8000",
         name: judge, weight: 0.5, timeout: 60}
"""

from __future__ import annotations

import asyncio
import json
import string
from collections.abc import Mapping
from typing import Any

import httpx

DEFAULT_RUBRIC = (
    "You grade an answer to a question.\n"
    "Question: {prompt}\n"
    "Reference answer: {answer}\n"
    "Answer to grade: {completion}\n"
    "Give a score from {min_score} (wrong) to {max_score} (correct and clear) as JSON: "
    '{{"score": <integer>}}.'
)


class _Fields(dict):
    """A record's fields for the rubric; a field the record lacks renders as ''."""

    def __missing__(self, key: str) -> str:
        return ""


class JudgeReward:
    """Score ``completion`` with a judge model at ``url`` (its ``/v1/chat/completions``).

    ``rubric``: a ``str.format`` template over the record's fields, ``completion``,
    ``min_score`` and ``max_score``; the reward is ``(score - min_score) / (max_score -
    min_score)`` (``normalize``), else the score. ``model``, ``seed``, ``temperature``,
    ``max_tokens``: the request's; ``api_key``: a bearer token; ``request_timeout``:
    seconds per request."""

    def __init__(
        self,
        url: str,
        *,
        rubric: str = DEFAULT_RUBRIC,
        model: str = "default",
        min_score: int = 0,
        max_score: int = 10,
        normalize: bool = True,
        seed: int = 0,
        temperature: float = 0.0,
        max_tokens: int = 32,
        api_key: str | None = None,
        request_timeout: float = 60.0,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"JudgeReward url must be an http(s) URL, got {url!r}")
        if not int(min_score) < int(max_score):
            raise ValueError(
                f"JudgeReward needs min_score < max_score, got {min_score}, {max_score}"
            )
        fields = {name for _, name, _, _ in string.Formatter().parse(rubric) if name}
        if "completion" not in fields:
            raise ValueError("JudgeReward rubric must contain {completion}")
        self.url = url.rstrip("/")
        self.endpoint = (
            self.url
            if self.url.endswith("/chat/completions")
            else self.url + "/v1/chat/completions"
        )
        self.rubric = rubric
        self.model = model
        self.min_score, self.max_score = int(min_score), int(max_score)
        self.normalize = bool(normalize)
        self.seed = int(seed)
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.request_timeout = float(request_timeout)

    @property
    def schema(self) -> dict[str, Any]:
        """The verdict's JSON schema: ``{"score": <integer in range>}``, nothing else."""
        scores = list(range(self.min_score, self.max_score + 1))
        return {
            "type": "object",
            "properties": {"score": {"type": "integer", "enum": scores}},
            "required": ["score"],
            "additionalProperties": False,
        }

    def request(self, record: Mapping[str, Any], completion: str) -> dict[str, Any]:
        """The chat request for one completion."""
        fields = _Fields(record)
        fields.update(completion=completion, min_score=self.min_score, max_score=self.max_score)
        prompt = self.rubric.format_map(fields)
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": self.temperature,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "verdict", "strict": True, "schema": self.schema},
            },
        }

    def verdict(self, content: str) -> float:
        """The reward of the judge's answer text; a ValueError when it is not a verdict."""
        try:
            score = json.loads(content)["score"]
        except (json.JSONDecodeError, TypeError, KeyError) as err:
            raise ValueError(f"judge verdict is not {{'score': int}}: {content!r}") from err
        if isinstance(score, bool) or not isinstance(score, int):
            raise ValueError(f"judge score is not an integer: {content!r}")
        if not self.min_score <= score <= self.max_score:
            raise ValueError(f"judge score {score} outside [{self.min_score}, {self.max_score}]")
        if not self.normalize:
            return float(score)
        return (score - self.min_score) / (self.max_score - self.min_score)

    async def __call__(self, record: Mapping[str, Any], completion: str) -> float:
        async with httpx.AsyncClient(timeout=self.request_timeout) as client:
            response = await client.post(
                self.endpoint, json=self.request(record, completion), headers=self.headers
            )
        response.raise_for_status()
        content = response.json()["choices"][0]["message"]["content"]
        return self.verdict(content or "")

    def score(self, record: Mapping[str, Any], completion: str) -> float:
        """One completion, synchronously (outside a training run's pool)."""
        return asyncio.run(self(record, completion))

    def __repr__(self) -> str:
        return f"JudgeReward({self.url!r}, model={self.model!r}, seed={self.seed})"
