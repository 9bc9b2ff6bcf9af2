"""The dense path's per-token scores from vocabulary-sharded logits (tensor parallelism,
`strategy.logits_chunk_size: null`): each rank holds the logits of its `V/N` vocabulary
rows (`[B, S, V/N]`, a DTensor sharded on the last dimension) and the log-softmax is
computed over the whole vocabulary by all-reducing a max, the sums of exponentials and the
target's logit over the tensor-parallel group: the full `[B, S, V]` logits never exist on
one process (Megatron's vocabulary-parallel cross entropy; torch's `loss_parallel`, which
needs its context around backward too, which Lightning's loop does not give).

The sums are reduced by an all-reduce whose backward is the identity: every rank computes
the same (replicated) loss from the reduced values, so each rank's logits receive exactly
their own share of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from astrai.model.head import IGNORE_INDEX, TokenScores

__all__ = ["vocab_parallel_scores"]


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward (the result feeds a replicated loss)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: Any) -> Tensor:
        out = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _max_over_ranks(t: Tensor, group: Any) -> Tensor:
    out = t.detach().clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def vocab_parallel_scores(
    logits: DTensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    label_smoothing: bool = False,
) -> TokenScores:
    """`TokenScores` `[B, S]` of `targets` (global ids; `IGNORE_INDEX`: 0) under `logits`
    `[B, S, V]` sharded evenly on the vocabulary over a 1-D mesh, divided by `temperature`:
    the values of the dense path's `token_logprobs` / `token_entropy` / smoothing term."""
    mesh = logits.device_mesh
    group = mesh.get_group()
    z = logits.to_local().float()
    if temperature != 1.0:
        z = z / temperature
    v_local = z.shape[-1]
    keep = targets != IGNORE_INDEX
    local = targets - mesh.get_local_rank() * v_local
    hit = keep & (local >= 0) & (local < v_local)
    m = _max_over_ranks(z.amax(-1), group)
    e = torch.exp(z - m[..., None])
    picked = z.gather(-1, local.clamp(0, v_local - 1)[..., None])[..., 0]
    parts = [e.sum(-1), torch.where(hit, picked, 0.0)]
    if label_smoothing:
        parts.append(z.sum(-1))
    sums = _SumOverRanks.apply(torch.stack(parts), group)
    lse = m + torch.log(sums[0])
    logp = torch.where(keep, sums[1] - lse, 0.0)
    smooth = None
    if label_smoothing:
        smooth = torch.where(keep, lse - sums[2] / (v_local * mesh.size()), 0.0)
    ent = None
    if entropy:  # with gradient (GRPO's entropy bonus), through the ranks' sums
        ez = _SumOverRanks.apply((e * z).sum(-1), group)
        ent = torch.where(keep, lse - ez / sums[0], 0.0)
    return TokenScores(logp, ent, smooth)
