"""Bradley-Terry reward models (``strategy=reward``), TRL's ``RewardTrainer`` semantics.

A reward model ``r(x, y)`` (`astrai.model.reward.RewardModel`: the policy's backbone with a
scalar head on the last token) is fitted to preference pairs under the Bradley-Terry model
``P(y_c > y_r | x) = sigmoid(r_c - r_r)`` (Bradley & Terry 1952; Christiano et al. 2017;
Stiennon et al. 2020; Ouyang et al. 2022)::

    loss = -log sigmoid(r_c - r_r - margin) + center_rewards_coefficient * mean((r_c + r_r)^2)

``margin`` is a per-pair minimum gap (Llama 2, Touvron et al. 2023: larger for clearer
preferences), read from the batch's ``margin`` column when there is one; the built-in
``prepare kind=preference`` stores none, so it comes from a custom collate function
(``batch["margin"]``, a float tensor ``[B]``), as with TRL's collator. The second term
(Eisenstein et al. 2023, Eq. 2; TRL's ``center_rewards_coefficient``, 0.01 recommended,
default off) keeps rewards centred on zero, which the pairwise loss alone leaves free.

What is scored: each side of a preference batch up to its last assistant token (the
closing stop token), the same tokens `astrai.model.reward.render_for_reward` produces for
``(prompt, completion)``, so GRPO and the server score what the model was trained on.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.model.moe import inactive_expert_parameters
from astrai.model.reward import (
    RewardModel,
    last_token_rewards,
    load_reward_model,
    reward_dir_problem,
    save_reward_model,
)
from astrai.train.module import LMModule
from astrai.train.preference import reward_inputs

log = logging.getLogger(__name__)

__all__ = ["RewardModule", "reward_loss"]


def reward_loss(
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean Bradley-Terry loss over the pairs (see the module docstring) and the metrics
    TRL logs: ``accuracy`` (share of pairs with ``r_c > r_r``), ``margin`` (mean
    ``r_c - r_r``), and the mean rewards ``rewards/chosen`` / ``rewards/rejected``."""
    diff = chosen - rejected
    logits = diff if margin is None else diff - margin.to(diff)
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
    d = diff.detach()
    metrics = {
        "accuracy": (d > 0).float().mean(),
        "margin": d.mean(),
        "rewards/chosen": chosen.detach().mean(),
        "rewards/rejected": rejected.detach().mean(),
    }
    return loss, metrics


def _check_coefficient(value: float | None) -> float | None:
    if value is None:
        return None
    try:
        coef = float(value)
    except (TypeError, ValueError):
        coef = math.nan
    if not (math.isfinite(coef) and coef >= 0):
        raise ValueError(
            f"strategy.center_rewards_coefficient: must be null or a number >= 0 (0.01 is "
            f"TRL's recommendation), got {value!r}"
        )
    return coef


class RewardModule(LMModule):
    """A Bradley-Terry reward model trained on preference batches (``chosen_*`` /
    ``rejected_*``, see ``PreferenceDataset``; an optional ``margin`` column).

    Args:
        center_rewards_coefficient: TRL's: weight of ``mean((r_c + r_r)^2)`` added to the
            loss (None: off).

    The other arguments are ``LMModule``'s. ``model`` builds the backbone, which becomes a
    `RewardModel` (its ``lm_head`` dropped, a ``score`` head added, initialised as
    transformers does: normal with ``initializer_range``); the head lives inside
    ``self.model``, so the optimizer, the gradient statistics and the checkpoint see it.
    ``init_from`` (an SFT export) initialises the backbone; an earlier reward-model export
    initialises the head too. ``lora``: adapters on the backbone, the head fully trainable
    (what PEFT's ``modules_to_save=["score"]`` does). Exports (``save_pretrained``) are
    transformers ``*ForSequenceClassification`` directories whatever ``hf_format`` says.
    """

    def __init__(self, *, center_rewards_coefficient: float | None = None, **kwargs: Any) -> None:
        coef = _check_coefficient(center_rewards_coefficient)
        init_from = kwargs.get("init_from")
        from_reward = bool(init_from) and Path(str(init_from)).is_dir()
        from_reward = from_reward and reward_dir_problem(str(init_from)) is None
        # a reward export is loaded below, head included; LMModule loads causal-LM exports
        super().__init__(**({**kwargs, "init_from": None} if from_reward else kwargs))
        self.center_rewards_coefficient = coef
        self.model = RewardModel.from_backbone(self.model)
        if from_reward:
            self._init_from_reward(str(init_from))
        active = self.model.num_parameters() - inactive_expert_parameters(self.model)
        self.flops_per_token = 6.0 * active

    def _init_from_reward(self, path: str) -> None:
        src = load_reward_model(path, dtype=torch.float32)
        ours, theirs = self.model.config.to_dict(), src.config.to_dict()
        diff = {
            k: (ours.get(k), theirs.get(k)) for k in ours | theirs if ours.get(k) != theirs.get(k)
        }
        for key in ("torch_dtype", "pad_token_id"):
            diff.pop(key, None)
        if diff:
            raise ValueError(f"init_from: {path} does not match the configured model: {diff}")
        theirs_sd = src.state_dict()
        state = {
            key: theirs_sd[key.replace(".base_layer.", ".")]
            for key in self.model.state_dict()
            if ".lora_" not in key
        }
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)
        log.info("init_from: loaded the reward model %s (backbone and score head)", path)

    def setup(self, stage: str) -> None:
        from lightning.pytorch.strategies import FSDPStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            raise ValueError(
                "strategy=reward: FSDP is not supported (its export gathers a causal LM); "
                "train reward models with ddp or a single device"
            )
        super().setup(stage)

    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        ids, last = reward_inputs(batch)
        rewards = last_token_rewards(self.model, ids, last)
        rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
        b = batch["chosen_input_ids"].shape[0]
        return reward_loss(
            rewards[:b], rewards[b:], batch.get("margin"), self.center_rewards_coefficient
        )

    def save_pretrained(self, path: str | Path, **kwargs: Any) -> Path:
        """The (merged) reward model with the tokenizer as a transformers
        sequence-classification directory (``hf_format`` is implied)."""
        kwargs.pop("hf_format", None)
        return save_reward_model(self.export_model(), path, tokenizer=self.tokenizer, **kwargs)
