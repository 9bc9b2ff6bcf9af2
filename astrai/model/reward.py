"""Reward models: our `Transformer` backbone with a scalar ``score`` head.

A Bradley-Terry reward model (Christiano et al. 2017; Stiennon et al. 2020; Ouyang et al.
2022) maps a whole conversation to one number ``r(x, y)``, trained so that
``P(y_c > y_r | x) = sigmoid(r(x, y_c) - r(x, y_r))`` (`astrai.train.strategies.reward`).
Here, as in transformers' ``*ForSequenceClassification`` with ``num_labels=1``, the reward
is ``score(h_last)``: a bias-free ``Linear(hidden, 1)`` applied to the final-normed hidden
state of the sequence's last token.

The directory format is transformers': backbone tensors under ``model.*``, the head as
``score.weight``, no ``lm_head``, and a ``config.json`` whose architecture is the family's
``*ForSequenceClassification`` with ``num_labels=1`` and ``pad_token_id`` (transformers pools
at the last token that is not padding). ``AutoModelForSequenceClassification`` and TRL's
``RewardTrainer`` load it as is; :func:`load_reward_model` refuses a directory without a
``score.weight`` (a causal-LM export) before it reads any weight.

What is scored: :func:`render_for_reward` renders ``(prompt, completion)`` with the chat
template exactly as ``prepare kind=preference`` renders a pair, and keeps the tokens up to
the completion's last assistant token (its closing stop token, e.g. ``<|im_end|>``):
separators a template adds after it are not scored. Training scores the same tokens of a
preference batch, so a reward model scores exactly what it was trained on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from astrai.model.hub import DEFAULT_MAX_SHARD_SIZE, CheckpointError
from astrai.model.scalar_head import (
    SCORE_KEY,
    ScalarHeadModel,
    head_config_to_hf,
    load_head_model,
    pad_token_id_for,
    save_head_model,
    stored_tensor_names,
)
from astrai.tokenizer.chat import TURNS_FORMS, as_turns

if TYPE_CHECKING:
    from astrai.model.config import ModelConfig

DEFAULT_MAX_BATCH_TOKENS = 8192

__all__ = [
    "SCORE_KEY",
    "RewardModel",
    "last_token_rewards",
    "load_reward_model",
    "pack_sequences",
    "render_for_reward",
    "reward_config_to_hf",
    "reward_dir_problem",
    "save_reward_model",
    "score_sequences",
]


# ---------------------------------------------------------------------- the model
class RewardModel(ScalarHeadModel):
    """A `Transformer` without ``lm_head`` and with ``score = Linear(hidden, 1, bias=False)``
    (`ScalarHeadModel`: LoRA, gradient checkpointing, ``model.compile`` and the rest work
    unchanged). ``forward`` returns the reward of every position ``[B, S]``
    (``return_hidden=True``: the final-normed hidden states); a sequence's reward is the value
    at its last token. ``from_backbone(policy)`` takes a policy's blocks over and adds a
    freshly initialised head (transformers' normal(0, initializer_range))."""

    score_bias = False


def last_token_rewards(
    model: RewardModel, input_ids: torch.Tensor, last: torch.Tensor
) -> torch.Tensor:
    """Rewards ``[B]`` of a dense, right-padded ``[B, S]`` batch, row ``b`` scored at token
    ``last[b]``; the head runs on those rows only. Right padding under a causal mask never
    changes earlier positions, so no attention mask is needed."""
    hidden = model(input_ids, return_hidden=True)
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return model.score(hidden[rows, last.to(input_ids.device)]).squeeze(-1)


# ---------------------------------------------------------------------- packed scoring
def pack_sequences(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped in order into packs of at most ``max_batch_tokens``
    tokens (a longer sequence gets a pack of its own)."""
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens: must be >= 1, got {max_batch_tokens}")
    packs: list[list[int]] = []
    size = 0
    for i, n in enumerate(lengths):
        if not packs or size + n > max_batch_tokens:
            packs.append([])
            size = 0
        packs[-1].append(i)
        size += n
    return packs


@torch.no_grad()
def score_sequences(
    model: RewardModel,
    sequences: Sequence[Sequence[int]],
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
) -> list[float]:
    """The reward of each token-id sequence, in order.

    Sequences are packed padding-free into one row per pack (position ids restart at every
    sequence, so none attends to another), one forward per pack of at most
    ``max_batch_tokens`` tokens, and the head runs on each sequence's last token only.
    """
    if any(len(s) == 0 for s in sequences):
        raise ValueError("score_sequences: a sequence is empty")
    device = model.embed_tokens.weight.device
    out = [0.0] * len(sequences)
    for pack in pack_sequences([len(s) for s in sequences], max_batch_tokens):
        ids = [t for i in pack for t in sequences[i]]
        pos = [p for i in pack for p in range(len(sequences[i]))]
        ends = torch.tensor([len(sequences[i]) for i in pack]).cumsum(0) - 1
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        position_ids = torch.tensor([pos], dtype=torch.long, device=device)
        hidden = model(input_ids, position_ids=position_ids, return_hidden=True)[0]
        values = model.score(hidden[ends.to(device)]).squeeze(-1).float().tolist()
        for i, v in zip(pack, values):
            out[i] = v
    return out


# ---------------------------------------------------------------------- rendering
def _messages(value: Any, role: str, name: str) -> list[dict[str, Any]]:
    turns = as_turns(value, role)
    if turns is None:
        raise ValueError(f"{name} {TURNS_FORMS}")
    return turns


def render_for_reward(
    tokenizer: Any,
    prompt: Any,
    completion: Any,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The token ids a reward model scores for ``completion`` answering ``prompt``.

    ``prompt``: a string (one user turn), a message or a list of messages; ``completion``: a
    string (one assistant turn) or messages. Rendered with the tokenizer's chat template as
    ``prepare kind=preference`` renders a pair, then cut after the last assistant token.
    """
    messages = _messages(prompt, "user", "prompt") + _messages(
        completion, "assistant", "completion"
    )
    ids, mask = tokenizer.encode_chat(messages, tools=tools)
    last = max((i for i, m in enumerate(mask) if m), default=len(ids) - 1)
    return list(ids[: last + 1])


# ---------------------------------------------------------------------- directories
def reward_config_to_hf(
    config: ModelConfig, dtype: torch.dtype = torch.float32, pad_token_id: int | None = None
) -> dict[str, Any]:
    """The family's ``config.json`` as a one-label ``*ForSequenceClassification``."""
    return head_config_to_hf(config, "SequenceClassification", dtype, pad_token_id)


def save_reward_model(
    model: RewardModel,
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``config.json``, safetensors weights (sharded above ``max_shard_size`` bytes)
    and the tokenizer: a directory ``AutoModelForSequenceClassification`` loads.

    ``pad_token_id`` is the tokenizer's (else the model's, else EOS): the token
    transformers pools before. Each file is written under a temporary name and renamed.
    """
    stored_dtype = dtype if dtype is not None else model.score.weight.dtype
    hf_config = reward_config_to_hf(model.config, stored_dtype, pad_token_id_for(model, tokenizer))
    return save_head_model(
        model,
        path,
        hf_config,
        tokenizer=tokenizer,
        dtype=dtype,
        max_shard_size=max_shard_size,
    )


def reward_dir_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a reward-model directory (None: it has a ``score.weight``).

    Reads file names and safetensors headers only, so a wrong path fails in a moment.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        return f"reward model directory not found: {path}"
    try:
        names = stored_tensor_names(path)
    except (FileNotFoundError, CheckpointError) as err:
        return str(err)
    if SCORE_KEY not in names:
        what = "a causal-LM export (lm_head.weight)" if "lm_head.weight" in names else "it"
        return (
            f"{path} is not a reward model: it has no {SCORE_KEY} tensor (the scalar head of a "
            f"sequence-classification export); {what} cannot score. Train one with "
            "strategy=reward, whose export has the head"
        )
    return None


def load_reward_model(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> RewardModel:
    """A `RewardModel` from a directory with a ``score.weight`` (ours or transformers'
    ``*ForSequenceClassification`` with one label), in eval mode; anything else is refused
    first, naming the directory and what is missing."""
    problem = reward_dir_problem(path)
    if problem is not None:
        raise CheckpointError(problem)
    model, _ = load_head_model(RewardModel, path, device=device, dtype=dtype)
    return model
