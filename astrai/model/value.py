"""Value models: PPO's critic, our `Transformer` backbone with a per-token value head.

The critic estimates ``V(s_t)``, the expected return from every prefix of a rollout, for
GAE (`astrai.train.strategies.ppo`). As verl's critic (``AutoModelForTokenClassification``
with ``num_labels=1``) and transformers' ``*ForTokenClassification``, the value of position
``t`` is ``score(h_t)``: a ``Linear(hidden, 1)`` with a bias applied to the final-normed
hidden state of every token, so ``forward(input_ids)`` is ``[B, S]``.

Where a critic starts (:func:`check_value_source` names the kind, from ``config.json`` and
the weight index alone, so a wrong ``strategy.critic.init`` is refused before any model is
built):

- ``token_classification``: a critic's own export (:func:`save_value_model`, or
  transformers' / verl's ``*ForTokenClassification`` with one label): backbone and head.
- ``sequence_classification``: a reward model's export (``strategy=reward``, TRL's
  ``RewardTrainer``): backbone and ``score.weight``, bias 0. Its head already scores the
  last token of a conversation, the position whose value PPO's outcome reward lands on.
- ``causal_lm``: a policy's export (ours or a transformers ``*ForCausalLM``): the backbone,
  ``lm_head`` dropped, a fresh head (transformers' initialisation), said once in the log.

:meth:`ValueModel.from_policy` is the same start from a live policy without a directory:
its own copy of the policy's blocks (the critic trains apart from the policy).

The export (:func:`save_value_model`) is transformers': ``<Family>ForTokenClassification``,
``num_labels=1``, ``classifier_dropout=0`` (as verl sets it: the head here has no dropout,
so transformers trains the same function), backbone under ``model.*``, ``score.weight`` and
``score.bias``. ``AutoModelForTokenClassification`` loads it with equal logits ``[B, S, 1]``
for every family transformers has such a class for (all but DeepSeek-V2, whose export loads
here only).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from astrai.model.config import ConfigError
from astrai.model.directory import CONFIG_NAME
from astrai.model.hub import DEFAULT_MAX_SHARD_SIZE, CheckpointError, read_config
from astrai.model.scalar_head import (
    SCORE_BIAS_KEY,
    SCORE_KEY,
    ScalarHeadModel,
    head_config_to_hf,
    load_head_model,
    pad_token_id_for,
    save_head_model,
    stored_tensor_names,
)

if TYPE_CHECKING:
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import Transformer
    from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

ValueSource = Literal["token_classification", "sequence_classification", "causal_lm"]

# config.json's architecture suffix -> the kind of start it gives a critic
ARCHITECTURE_KINDS: dict[str, ValueSource] = {
    "ForTokenClassification": "token_classification",
    "ForSequenceClassification": "sequence_classification",
    "ForCausalLM": "causal_lm",
}
EMBED_KEY = "model.embed_tokens.weight"
# head tensors each kind must store / may lack (what it lacks starts fresh)
_REQUIRED_HEAD: dict[ValueSource, tuple[str, ...]] = {
    "token_classification": (SCORE_KEY,),
    "sequence_classification": (SCORE_KEY,),
    "causal_lm": (),
}
_OPTIONAL_HEAD: dict[ValueSource, frozenset[str]] = {
    "token_classification": frozenset({SCORE_BIAS_KEY}),  # token_classification_bias=false
    "sequence_classification": frozenset({SCORE_BIAS_KEY}),
    "causal_lm": frozenset({SCORE_KEY, SCORE_BIAS_KEY}),
}

__all__ = [
    "ARCHITECTURE_KINDS",
    "ValueModel",
    "ValueSource",
    "check_value_source",
    "load_value_model",
    "save_value_model",
    "value_config_to_hf",
]


class ValueModel(ScalarHeadModel):
    """A `Transformer` without ``lm_head`` and with ``score = Linear(hidden, 1)`` (bias
    included), transformers' token-classification head with one label: ``forward`` returns
    the value of every position ``[B, S]``."""

    score_bias = True

    @classmethod
    def from_policy(cls, policy: Transformer) -> ValueModel:
        """A critic with its own deep copy of ``policy``'s backbone (``lm_head`` left out;
        nothing shared, so the two train apart) and a fresh head: weight
        normal(0, initializer_range), bias 0, as transformers initialises it."""
        return cls.from_backbone(policy, copy_blocks=True)


# ---------------------------------------------------------------------- sources
def _architecture_kind(data: dict[str, Any], where: str) -> ValueSource:
    architectures = data.get("architectures")
    if not architectures and data.get("model_type", "astrai") == "astrai":
        return "causal_lm"  # our own save_pretrained directory
    for name in architectures if isinstance(architectures, list) else ():
        for suffix, kind in ARCHITECTURE_KINDS.items():
            if isinstance(name, str) and name.endswith(suffix):
                return kind
    raise ValueError(
        f"{where}: unknown architecture {architectures!r} in {CONFIG_NAME}; a critic starts "
        "from a *ForTokenClassification (a critic's export), *ForSequenceClassification (a "
        "reward model's) or *ForCausalLM (a policy's) directory"
    )


def check_value_source(path: str | os.PathLike) -> ValueSource:
    """The kind of critic start ``path`` is: ``token_classification``,
    ``sequence_classification`` or ``causal_lm``.

    Reads ``config.json`` and the weight index (or the safetensors headers) only, never a
    tensor: a path that is not such a model (missing, no ``config.json``, no weights, an
    unknown architecture or family, the head tensor its architecture promises absent, more
    than one label) is a `ValueError` naming the path and what is missing.
    """
    path = Path(path).expanduser()
    where = f"critic source {path}"
    if not path.is_dir():
        raise ValueError(f"{where}: directory not found")
    file = path / CONFIG_NAME
    if not file.is_file():
        raise ValueError(f"{where}: no {CONFIG_NAME} (not a model directory)")
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: {CONFIG_NAME} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {CONFIG_NAME} is not a JSON object")
    kind = _architecture_kind(data, where)
    try:
        read_config(path)  # the family and its fields: one we can build
    except ConfigError as err:
        raise ValueError(f"{where}: {err}") from None
    labels = data.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else data.get("num_labels")
    if kind != "causal_lm" and num_labels not in (None, 1):
        raise ValueError(
            f"{where}: {num_labels} labels; a value head has one (num_labels=1, one score "
            "per token)"
        )
    try:
        names = stored_tensor_names(path)
    except (FileNotFoundError, CheckpointError) as err:
        raise ValueError(f"{where}: no weights ({err})") from None
    missing = [k for k in (EMBED_KEY, *_REQUIRED_HEAD[kind]) if k not in names]
    if missing:
        raise ValueError(
            f"{where}: config.json says {kind}, but the weights have no {', '.join(missing)}"
        )
    return kind


def load_value_model(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> ValueModel:
    """A `ValueModel` from ``path`` (see :func:`check_value_source` for the kinds), in eval
    mode: a token-classification export with its head, a reward model's with its
    ``score.weight`` and bias 0, a causal LM's backbone with a fresh head (logged)."""
    kind = check_value_source(path)
    model, absent = load_head_model(
        ValueModel, path, device=device, dtype=dtype, optional=_OPTIONAL_HEAD[kind]
    )
    with torch.no_grad():
        if SCORE_KEY in absent:
            model.reset_score()
            logger.info(
                "critic from %s (a causal LM): backbone loaded, value head initialised fresh "
                "(normal(0, %g), bias 0)",
                path,
                model.config.initializer_range,
            )
        elif SCORE_BIAS_KEY in absent:
            model.score.bias.zero_()
    return model


# ---------------------------------------------------------------------- export
def value_config_to_hf(
    config: ModelConfig, dtype: torch.dtype = torch.float32, pad_token_id: int | None = None
) -> dict[str, Any]:
    """The family's ``config.json`` as a one-label ``*ForTokenClassification`` without
    dropout before the head (verl's ``classifier_dropout=0``)."""
    data = head_config_to_hf(config, "TokenClassification", dtype, pad_token_id)
    data["classifier_dropout"] = 0.0
    return data


def save_value_model(
    model: ValueModel,
    path: str | os.PathLike,
    tokenizer: AutoTokenizer | None = None,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``model`` as a ``*ForTokenClassification`` directory (config.json, safetensors
    sharded above ``max_shard_size`` bytes, the tokenizer) that
    ``AutoModelForTokenClassification`` and :func:`load_value_model` load; returns ``path``."""
    stored_dtype = dtype if dtype is not None else model.score.weight.dtype
    hf_config = value_config_to_hf(model.config, stored_dtype, pad_token_id_for(model, tokenizer))
    return save_head_model(
        model,
        path,
        hf_config,
        tokenizer=tokenizer,
        dtype=dtype,
        max_shard_size=max_shard_size,
    )
