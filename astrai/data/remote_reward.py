"""A reward computed by a service: completions POSTed to ``url``, one request per group
(the reward's async ``batch``), so a reward model or a sandbox behind HTTP runs while the
engine generates (:mod:`astrai.train.strategies.grpo.reward_pool`).

``format: plain`` is OpenRLHF's ``--remote_rm_url`` protocol (``remote_rm_fn``): the body
``{"query": [prompt + completion, ...], "prompts": [prompt, ...], "labels": [label, ...]}``,
the answer ``{"rewards": [float, ...]}`` (``score_key``), one per query in order.
``format: openai`` is vLLM's OpenAI-compatible Pooling API for reward models (``vllm serve
<reward model>``, ``POST /pooling``): the body ``{"model": model, "input": [prompt +
completion, ...]}``, the answer ``{"data": [{"index": i, "data": ...}, ...]}``, whose reward
is the last number of each ``data`` (a reward model's value at the sequence's last token). A
failed request, a bad answer or a wrong count is the reward's failure (its
``failure_value``).

    strategy.rewards:
      - {_target_: astrai.data.remote_reward.RemoteReward, url: "http://rm:5000/get_reward",
         name: rm, timeout: 30}
      - {_target_: astrai.data.remote_reward.RemoteReward, url: "http://rm:8000/pooling",
         format: openai, model: my-reward-model, name: rm2}
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

FORMATS = ("plain", "openai")


def prompt_text(record: Mapping[str, Any], field: str) -> str:
    """The record's prompt as text: a string field, or a chat's messages' contents."""
    value = record.get(field, "")
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        return "\n".join(str(m.get("content", "")) for m in value if isinstance(m, Mapping))
    return str(value)


def last_number(value: Any) -> float:
    """The last number of a (nested) list: a reward model's value at the last token."""
    while isinstance(value, list):
        if not value:
            raise ValueError("an empty pooling output")
        value = value[-1]
    return float(value)


def pooled_rewards(answer: Any, count: int, url: str) -> list[float]:
    """One reward per input from a Pooling API answer (``data[i].data``, by ``index``)."""
    data = answer.get("data") if isinstance(answer, Mapping) else None
    if not isinstance(data, list) or len(data) != count:
        raise ValueError(f"{url}: expected {count} pooling outputs in 'data', got {answer!r}")
    ordered = sorted(data, key=lambda item: int(item.get("index", 0)))
    return [last_number(item.get("data")) for item in ordered]


class RemoteReward:
    """POST a group's completions to ``url`` (OpenRLHF's body), read one reward each.

    ``prompt_field``: the record's prompt (a string, or ``messages``); ``label_field``: the
    reference answer sent as ``labels`` ("" when absent); ``headers`` / ``api_key`` (sent as
    a bearer token); ``request_timeout``: seconds per request (the entry's ``timeout`` bounds
    the whole call, retries included); ``model``: the served model's name (``openai``)."""

    def __init__(
        self,
        url: str,
        *,
        format: str = "plain",
        prompt_field: str = "prompt",
        label_field: str = "answer",
        score_key: str = "rewards",
        headers: Mapping[str, str] | None = None,
        api_key: str | None = None,
        request_timeout: float = 60.0,
        model: str | None = None,
    ) -> None:
        if format not in FORMATS:
            raise ValueError(f"RemoteReward format must be one of {FORMATS}, got {format!r}")
        if format == "openai" and not model:
            raise ValueError("RemoteReward format openai needs model (the served model's name)")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteReward url must be an http(s) URL, got {url!r}")
        self.url = url
        self.format = format
        self.prompt_field = prompt_field
        self.label_field = label_field
        self.score_key = score_key
        self.headers = dict(headers or {})
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.request_timeout = float(request_timeout)
        self.model = model

    def body(self, records: Sequence[Mapping[str, Any]], completions: Sequence[str]) -> dict:
        """The request's JSON (OpenRLHF ``remote_rm_fn``'s ``query`` / ``prompts`` / ``labels``,
        or the Pooling API's ``model`` / ``input``)."""
        prompts = [prompt_text(r, self.prompt_field) for r in records]
        if self.format == "openai":
            return {"model": self.model, "input": [p + c for p, c in zip(prompts, completions)]}
        return {
            "query": [p + c for p, c in zip(prompts, completions)],
            "prompts": prompts,
            "labels": [str(r.get(self.label_field, "")) for r in records],
        }

    async def batch(
        self, records: Sequence[Mapping[str, Any]], completions: Sequence[str]
    ) -> list[float]:
        async with httpx.AsyncClient(timeout=self.request_timeout) as client:
            response = await client.post(
                self.url, json=self.body(records, completions), headers=self.headers
            )
        response.raise_for_status()
        answer = response.json()
        if self.format == "openai":
            return pooled_rewards(answer, len(completions), self.url)
        if not isinstance(answer, Mapping) or self.score_key not in answer:
            raise ValueError(f"{self.url} answered without {self.score_key!r}: {answer!r}")
        values = answer[self.score_key]
        if not isinstance(values, list) or len(values) != len(completions):
            raise ValueError(
                f"{self.url}: expected {len(completions)} {self.score_key}, got {values!r}"
            )
        return [float(v) for v in values]

    def __call__(self, record: Mapping[str, Any], completion: str) -> float:
        """One completion, synchronously (outside a training run's pool)."""
        return asyncio.run(self.batch([record], [completion]))[0]

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, format={self.format!r})"
