"""DAPO's token normalisation over a whole optimizer step (TRL's ``num_items_in_batch``):
the completion tokens of every accumulated micro-batch on every rank, which no single
micro-batch knows when its backward runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from astrai.train.strategies.grpo.policy_losses import global_token_normalised


class GlobalTokenNormaliser:
    """A LightningModule mixin for a loss normalised like ``dapo`` (``loss_type`` dapo, cispo,
    clip_cov, kl_cov: :func:`~astrai.train.strategies.grpo.policy_losses.global_token_normalised`): each micro-batch
    backpropagates ``sum / max_new_tokens`` and counts its tokens
    (:meth:`count_window_tokens`); the gradients are rescaled to ``sum / T`` once the last
    micro-batch is in."""

    loss_type: str
    max_new_tokens: int
    window_tokens: Tensor = torch.zeros(())

    def count_window_tokens(self, tokens: Tensor) -> None:
        """Add a micro-batch's completion tokens to this optimizer step's count."""
        self.window_tokens = self.window_tokens.to(tokens.device) + tokens

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        """``dapo``: once the last micro-batch's backward is done (inside the closure, so
        before the ``on_before_optimizer_step`` hooks, clipping and the step), rescale the
        gradients from ``sum / max_new_tokens`` per micro-batch to ``sum / T``, where ``T`` is
        the completion-token count of the window summed over all ranks (TRL's
        ``num_items_in_batch``). Lightning divided each micro-batch's loss by
        ``accumulate_grad_batches`` and DDP averaged the ranks, hence the factors."""
        if global_token_normalised(self.loss_type) and optimizer_closure is not None:
            closure = optimizer_closure

            def optimizer_closure() -> Any:
                out = closure()
                self.normalise_by_global_tokens()
                return out

        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    @torch.no_grad()
    def normalise_by_global_tokens(self) -> None:
        tokens = self.window_tokens.to(self.device, torch.float32)
        total = self.trainer.strategy.reduce(tokens, reduce_op="sum")
        factors = self.trainer.world_size * self.trainer.accumulate_grad_batches
        scale = factors * self.max_new_tokens / total.clamp(min=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
        self.window_tokens = torch.zeros(())
