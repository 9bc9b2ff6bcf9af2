"""A trained reward model as a GRPO reward (``strategy.rewards`` entry by path).

::

    strategy:
      rewards:
        - {_target_: astrai.train.learned_reward.LearnedReward,
           model_path: outputs/tiny_reward/latest/export, weight: 1.0}

The reward of a completion is ``r(x, y)`` of a Bradley-Terry reward model
(``strategy=reward``'s export, or any transformers ``*ForSequenceClassification`` with one
label): the record's ``prompt`` (a string or messages, with the record's ``tools``) and the
completion are rendered with the reward model's own chat template exactly as its training
pairs were (`astrai.model.reward.render_for_reward`), packed padding-free and scored in one
forward per ``max_batch_tokens`` (`score_sequences`). The policy and the reward model need
not share a tokenizer: they meet in text.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from astrai.model.directory import model_dir_problem
from astrai.model.reward import (
    DEFAULT_MAX_BATCH_TOKENS,
    RewardModel,
    load_reward_model,
    render_for_reward,
    reward_dir_problem,
    score_sequences,
)

log = logging.getLogger(__name__)

__all__ = ["LearnedReward", "resolve_device"]


def resolve_device(device: str | None) -> torch.device:
    """``auto`` / None: this process's GPU (``cuda:$LOCAL_RANK``, so every data-parallel rank
    scores on its own) when CUDA is available, else the CPU; anything else as given."""
    if device in (None, "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    return torch.device(device)


class LearnedReward:
    """``reward(record, completion) -> float`` from a reward-model directory.

    Args:
        model_path: the reward model's directory (with its tokenizer). Checked here, when
            ``strategy.rewards`` is parsed, before any training: a missing directory, or one
            without a ``score.weight`` head (e.g. a causal-LM export), is a ValueError naming
            ``model_path``.
        max_batch_tokens: tokens per packed forward (a longer sequence gets its own).
        device: ``auto`` (this rank's GPU, else CPU), ``cpu``, ``cuda:1``, ...
        dtype: e.g. ``bfloat16``; None keeps the stored dtype.

    Copies and pickles (GRPO may copy its rewards) carry the options only; the model is
    loaded again, once, on first use.
    """

    def __init__(
        self,
        model_path: str,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        device: str | None = "auto",
        dtype: str | None = None,
    ) -> None:
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: must be an int >= 1, got {max_batch_tokens!r}")
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"dtype: not a torch dtype: {dtype!r}")
        path = Path(str(model_path)).expanduser()
        problem = reward_dir_problem(path) or model_dir_problem(path)
        if problem is not None:
            raise ValueError(f"model_path={model_path}: {problem}")
        self.model_path = str(path)
        self.max_batch_tokens = max_batch_tokens
        self.device = device
        self.dtype = dtype
        self._lock = threading.Lock()
        self._model: RewardModel | None = None
        self._tokenizer: Any = None
        try:
            self._load()
        except (OSError, ValueError) as err:
            raise ValueError(f"model_path={model_path}: {err}") from err

    def _load(self) -> RewardModel:
        if self._model is None:
            from astrai.tokenizer import AutoTokenizer

            dtype = getattr(torch, self.dtype) if self.dtype else None
            device = resolve_device(self.device)
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            self._model = load_reward_model(self.model_path, device=device, dtype=dtype)
            log.info("reward model %s loaded on %s", self.model_path, device)
        return self._model

    def render(self, record: Mapping[str, Any], completion: str) -> list[int]:
        """The token ids scored for ``completion`` answering ``record["prompt"]``."""
        if not isinstance(record, Mapping) or "prompt" not in record:
            raise ValueError("LearnedReward: the record has no 'prompt' field")
        return render_for_reward(self._tokenizer, record["prompt"], completion, record.get("tools"))

    def batch(
        self, records: Sequence[Mapping[str, Any]], completions: Sequence[str]
    ) -> list[float]:
        """The reward of every ``(record, completion)``, in one packed pass."""
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completions")
        with self._lock:
            model = self._load()
            sequences = [self.render(r, c) for r, c in zip(records, completions)]
            return score_sequences(model, sequences, self.max_batch_tokens)

    def __call__(self, record: Mapping[str, Any], completion: str) -> float:
        return self.batch([record], [completion])[0]

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k != "_lock"}
        state["_model"] = state["_tokenizer"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"LearnedReward(model_path={self.model_path!r}, "
            f"max_batch_tokens={self.max_batch_tokens}, device={self.device!r})"
        )
