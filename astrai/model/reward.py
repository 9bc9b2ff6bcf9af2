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

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from astrai.model import hf_deepseek, hf_moe
from astrai.model.directory import CONFIG_NAME, INDEX_NAME
from astrai.model.hub import (
    DEFAULT_MAX_SHARD_SIZE,
    CheckpointError,
    check_state,
    config_to_hf,
    from_hf_key,
    hf_model_type,
    read_config,
    read_hf_state,
    to_hf_key,
    weight_files,
    write_weights,
)
from astrai.model.transformer import Transformer

if TYPE_CHECKING:
    from astrai.model.config import ModelConfig

logger = logging.getLogger(__name__)

SCORE_KEY = "score.weight"
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
class RewardModel(Transformer):
    """A `Transformer` without ``lm_head`` and with ``score = Linear(hidden, 1, bias=False)``.

    A subclass, so that everything that works on the policy (LoRA, gradient checkpointing,
    ``model.compile``, MoE router statistics, parameter counts) works here unchanged.
    ``forward`` returns the reward of every position ``[B, S]`` (``return_hidden=True``: the
    final-normed hidden states); a sequence's reward is the value at its last token.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        del self.lm_head  # a reward model has no vocabulary projection
        weight = self.embed_tokens.weight
        self.score = nn.Linear(
            config.hidden_size, 1, bias=False, device=weight.device, dtype=weight.dtype
        )
        if weight.device.type != "meta":
            self.reset_score()

    @classmethod
    def from_backbone(cls, backbone: Transformer) -> RewardModel:
        """A reward model that takes over ``backbone``'s blocks (shared, not copied: LoRA
        adapters and loaded weights stay) and adds a freshly initialised head; the
        backbone's ``lm_head`` is left behind."""
        with torch.device("meta"):
            model = cls(backbone.config)
        for name, child in backbone.named_children():
            if name != "lm_head":
                setattr(model, name, child)
        for attr in ("gradient_checkpointing", "compile_training", "lora_config"):
            if hasattr(backbone, attr):
                setattr(model, attr, getattr(backbone, attr))
        weight = model.embed_tokens.weight
        model.score = nn.Linear(
            model.config.hidden_size, 1, bias=False, device=weight.device, dtype=weight.dtype
        )
        model.reset_score()
        return model

    @torch.no_grad()
    def reset_score(self, generator: torch.Generator | None = None) -> None:
        """transformers' initialisation of the head: normal(0, initializer_range)."""
        self.score.weight.normal_(0.0, self.config.initializer_range, generator=generator)

    def tie_weights(self) -> None:
        """No output embedding to tie."""

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        hidden = super().forward(input_ids, position_ids, attention_mask, return_hidden=True)
        return hidden if return_hidden else self.score(hidden).squeeze(-1)

    def forward_packed(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise TypeError("a reward model scores sequences (score_sequences); it does not generate")


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
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, Mapping):
        return [dict(value)]
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return [dict(m) for m in value]
    raise ValueError(f"{name} must be a string, a message or a list of messages")


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
    data = config_to_hf(config, dtype)
    data["architectures"] = [
        a.replace("ForCausalLM", "ForSequenceClassification") for a in data["architectures"]
    ]
    data.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if pad_token_id is not None:
        data["pad_token_id"] = int(pad_token_id)
    return data


def _pad_id(model: RewardModel, tokenizer: Any) -> int | None:
    for value in (
        getattr(tokenizer, "pad_token_id", None),
        model.config.pad_token_id,
        getattr(tokenizer, "eos_token_id", None),
        model.config.eos_token_id,
    ):
        if value is not None:
            return int(value)
    return None


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
    if any(".lora_" in name for name, _ in model.named_parameters()):
        raise ValueError(
            "save_reward_model: the model has unmerged LoRA adapters; merge_lora(model) first"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to(dtype) if dtype is not None else tensor.detach()
        key = SCORE_KEY if name == SCORE_KEY else to_hf_key(name)
        state[key] = t.to("cpu").contiguous()
    stored_dtype = state[SCORE_KEY].dtype
    state = hf_deepseek.state_to_hf(state, config, unstack=True)
    state = hf_moe.state_to_hf(state, hf_model_type(config))
    names = write_weights(state, path, max_shard_size)
    (path / "generation_config.json").unlink(missing_ok=True)  # a causal export's, if any
    _write(path / CONFIG_NAME, reward_config_to_hf(config, stored_dtype, _pad_id(model, tokenizer)))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    logger.info("saved reward model (%d tensors, %d file(s)) to %s", len(state), len(names), path)
    return path


def _write(file: Path, data: dict[str, Any]) -> None:
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, file)


def _tensor_names(path: Path) -> set[str]:
    """Names of the stored tensors, from the index or the safetensors headers (no data)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err!r})") from None
    names: set[str] = set()
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                names.update(f.keys())
        except (SafetensorError, OSError) as err:
            raise CheckpointError(
                f"{file}: corrupt or truncated safetensors file ({err})"
            ) from None
    return names


def reward_dir_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a reward-model directory (None: it has a ``score.weight``).

    Reads file names and safetensors headers only, so a wrong path fails in a moment.
    """
    path = Path(path).expanduser()
    if not path.is_dir():
        return f"reward model directory not found: {path}"
    try:
        names = _tensor_names(path)
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
    path = Path(path).expanduser()
    config = read_config(path)
    with torch.device("meta"):
        model = RewardModel(config)
    expected = {
        (SCORE_KEY if k == SCORE_KEY else to_hf_key(k)): v for k, v in model.state_dict().items()
    }
    stored = read_hf_state(path, config, device)
    stored.pop("lm_head.weight", None)  # a model saved with both heads keeps only the score
    check_state(path, expected, stored, note=" (a reward model has one label)")
    state = {
        (k if k == SCORE_KEY else from_hf_key(k)): (v.to(dtype) if dtype is not None else v)
        for k, v in stored.items()
    }
    model.load_state_dict(state, assign=True)
    model.rotary.materialize(torch.device(device))
    return model.eval()
