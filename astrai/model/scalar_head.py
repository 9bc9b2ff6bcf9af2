"""A `Transformer` backbone whose ``lm_head`` is replaced by a one-output ``score`` head.

What a reward model (`astrai.model.reward`: transformers' ``*ForSequenceClassification``,
the value at the last token) and a PPO critic (`astrai.model.value`:
``*ForTokenClassification``, the value at every token) have in common lives here, once:
the module and its initialisation, and its transformers-style directory (backbone tensors
under ``model.*``, the head as ``score.weight`` and, with a bias, ``score.bias``; no
``lm_head``; a one-label ``config.json``). The two differ in the head's bias, the
architecture name and what they do with the per-position scores.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from astrai.model import hf_deepseek, hf_moe
from astrai.model.directory import CONFIG_NAME, INDEX_NAME
from astrai.model.hub import (
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
    from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

SCORE_KEY = "score.weight"
SCORE_BIAS_KEY = "score.bias"

M = TypeVar("M", bound="ScalarHeadModel")

__all__ = [
    "SCORE_BIAS_KEY",
    "SCORE_KEY",
    "ScalarHeadModel",
    "head_config_to_hf",
    "load_head_model",
    "pad_token_id_for",
    "save_head_model",
    "stored_tensor_names",
]


class ScalarHeadModel(Transformer):
    """A `Transformer` without ``lm_head`` and with ``score = Linear(hidden, 1)``.

    A subclass, so that everything that works on the policy (LoRA, gradient checkpointing,
    ``model.compile``, MoE router statistics, parameter counts) works here unchanged.
    ``forward`` returns the score of every position ``[B, S]`` (``return_hidden=True``: the
    final-normed hidden states). ``score_bias``: whether the head has a bias (transformers'
    sequence-classification head has none, its token-classification head has one).
    """

    score_bias: ClassVar[bool] = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        del self.lm_head  # no vocabulary projection
        self.score = self.new_score()
        if self.embed_tokens.weight.device.type != "meta":
            self.reset_score()

    def new_score(self) -> nn.Linear:
        """An uninitialised head on the embedding's device and dtype."""
        weight = self.embed_tokens.weight
        return nn.Linear(
            self.config.hidden_size,
            1,
            bias=self.score_bias,
            device=weight.device,
            dtype=weight.dtype,
        )

    @classmethod
    def from_backbone(cls: type[M], backbone: Transformer, *, copy_blocks: bool = False) -> M:
        """A model on ``backbone``'s blocks with a freshly initialised head; the backbone's
        ``lm_head`` is left behind. ``copy_blocks=False`` takes the blocks over (shared, not
        copied: LoRA adapters and loaded weights stay); ``True`` gives the model its own deep
        copy, so training it never touches ``backbone``."""
        config = copy.deepcopy(backbone.config) if copy_blocks else backbone.config
        with torch.device("meta"):
            model = cls(config)
        for name, child in backbone.named_children():
            if name != "lm_head":
                setattr(model, name, copy.deepcopy(child) if copy_blocks else child)
        for attr in ("gradient_checkpointing", "compile_training", "lora_config"):
            if hasattr(backbone, attr):
                setattr(model, attr, getattr(backbone, attr))
        model.score = model.new_score()
        model.reset_score()
        return model

    @torch.no_grad()
    def reset_score(self, generator: torch.Generator | None = None) -> None:
        """transformers' initialisation of the head: weight normal(0, initializer_range),
        bias 0."""
        self.score.weight.normal_(0.0, self.config.initializer_range, generator=generator)
        if self.score_bias:
            self.score.bias.zero_()

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
        raise TypeError(
            f"a {type(self).__name__} scores tokens (its forward); it does not generate"
        )


# ---------------------------------------------------------------------- directories
def _to_stored(name: str) -> str:
    return name if name.startswith("score.") else to_hf_key(name)


def _from_stored(name: str) -> str:
    return name if name.startswith("score.") else from_hf_key(name)


def head_config_to_hf(
    config: ModelConfig,
    task: str,
    dtype: torch.dtype = torch.float32,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The family's ``config.json`` as a one-label ``*For<task>`` (``task``:
    ``SequenceClassification`` or ``TokenClassification``)."""
    data = config_to_hf(config, dtype)
    data["architectures"] = [a.replace("ForCausalLM", f"For{task}") for a in data["architectures"]]
    data.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if pad_token_id is not None:
        data["pad_token_id"] = int(pad_token_id)
    return data


def pad_token_id_for(model: Transformer, tokenizer: AutoTokenizer | None) -> int | None:
    """The tokenizer's pad id, else the model's, else EOS (the tokenizer's, the model's)."""
    tok_pad = tokenizer.pad_token_id if tokenizer is not None else None
    tok_eos = tokenizer.eos_token_id if tokenizer is not None else None
    for value in (tok_pad, model.config.pad_token_id, tok_eos, model.config.eos_token_id):
        if value is not None:
            return int(value)
    return None


def save_head_model(
    model: ScalarHeadModel,
    path: str | os.PathLike,
    hf_config: dict[str, Any],
    *,
    tokenizer: AutoTokenizer | None,
    dtype: torch.dtype | None,
    max_shard_size: int | str,
) -> Path:
    """Write ``hf_config`` as ``config.json``, the weights as safetensors (sharded above
    ``max_shard_size`` bytes; backbone under ``model.*``, the head under ``score.*``) and
    the tokenizer. Each file is written under a temporary name and renamed."""
    if any(".lora_" in name for name, _ in model.named_parameters()):
        raise ValueError(
            f"saving a {type(model).__name__}: the model has unmerged LoRA adapters; "
            "merge_lora(model) first"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().to(dtype) if dtype is not None else tensor.detach()
        state[_to_stored(name)] = t.to("cpu").contiguous()
    state = hf_deepseek.state_to_hf(state, model.config, unstack=True)
    state = hf_moe.state_to_hf(state, hf_model_type(model.config))
    names = write_weights(state, path, max_shard_size)
    (path / "generation_config.json").unlink(missing_ok=True)  # a causal export's, if any
    tmp = path / f".{CONFIG_NAME}.tmp"
    tmp.write_text(json.dumps(hf_config, indent=2))
    os.replace(tmp, path / CONFIG_NAME)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    logger.info(
        "saved %s (%d tensors, %d file(s)) to %s",
        type(model).__name__,
        len(state),
        len(names),
        path,
    )
    return path


def stored_tensor_names(path: str | os.PathLike) -> set[str]:
    """Names of a directory's stored tensors, from the index or the safetensors headers (no
    tensor data is read)."""
    path = Path(path)
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


def load_head_model(
    cls: type[M],
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    optional: frozenset[str] = frozenset(),
) -> tuple[M, set[str]]:
    """A ``cls`` from ``path`` in eval mode, and the stored names of the head tensors that
    were absent (only those in ``optional`` may be: they are left uninitialised on
    ``device``, for the caller to fill). A stored ``lm_head.weight`` is ignored; any other
    missing, unexpected or misshapen tensor is a `CheckpointError` naming ``path``."""
    path = Path(path).expanduser()
    config = read_config(path)
    with torch.device("meta"):
        model = cls(config)
    expected = {_to_stored(k): v for k, v in model.state_dict().items()}
    stored = read_hf_state(path, config, device)
    stored.pop("lm_head.weight", None)  # a model saved with both heads keeps only the score
    absent = {k for k in optional if k not in stored}
    check_state(
        path,
        {k: v for k, v in expected.items() if k not in absent},
        stored,
        note=" (a scalar head has one label)",
    )
    state = {_from_stored(k): (v.to(dtype) if dtype is not None else v) for k, v in stored.items()}
    model.load_state_dict(state, strict=not absent, assign=True)
    if absent:  # the head is remade on the loaded backbone's device and dtype
        kept = {k.removeprefix("score."): state[k] for k in state if k.startswith("score.")}
        model.score = model.new_score()
        model.score.load_state_dict(kept, strict=False, assign=True)
    model.rotary.materialize(torch.device(device))
    return model.eval(), absent
