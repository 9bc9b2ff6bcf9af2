"""The LM head applied in chunks: per-token log-probs (and entropy, and label smoothing's
term) that never hold the ``[tokens, vocab]`` logits.

A training loss needs, per target token, ``log p(target)`` of ``softmax(hidden @ W.T / T)``
(``T``: the sampling temperature); with 150k-token vocabularies and thousands of tokens the
full logits dwarf the model's activations. Here they are computed one block of ``chunk_size``
tokens by ``vocab_chunk_size`` vocabulary rows at a time, with an online log-sum-exp (a
running max and sum of exponentials), so the memory is flat in the vocabulary size. Backward
recomputes each block from the saved log-sum-exp: the gradient of the logits is
``(softmax - onehot) * g / T``, accumulated into the hidden states' and the head's gradients.

Every reduction across the vocabulary (max, sums of exponentials, the target's logit,
entropy and smoothing sums) goes through a :class:`~astrai.vocab.VocabShard`, and backward
all-reduces the hidden states' gradient through it: the same code computes a head split by
vocabulary rows over a tensor-parallel group.

``Transformer.forward(..., targets=, head=HeadSettings(...))`` runs this inside the model's
forward (so FSDP2's and tensor parallelism's hooks apply) and returns :class:`TokenScores`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from astrai.vocab import VocabShard

__all__ = [
    "HeadSettings",
    "TokenScores",
    "chunked_token_scores",
    "head_scores",
    "local_rows",
]

#: PyTorch's cross-entropy default, the datasets' ``IGNORE_INDEX`` (tested equal): a target
#: position that takes no part (the model imports nothing from ``astrai.data``)
IGNORE_INDEX = -100


@dataclass(frozen=True)
class HeadSettings:
    """What the chunked head computes and in which blocks.

    Attributes:
        chunk_size: target tokens per block (``strategy.logits_chunk_size``).
        vocab_chunk_size: vocabulary rows per block (of this process's head rows).
        temperature: the logits are divided by it (GRPO's sampling temperature; TRL's).
        entropy: also return each token's entropy (with gradient: GRPO's entropy bonus; the
            backward pays for it only when the entropy's gradient is not zero).
        label_smoothing: also return each token's mean over the vocabulary of ``-log p``
            (with gradient), the term label-smoothed cross entropy mixes in.
        dtype: of the softmax arithmetic and the scores: fp32, as the dense path's
            ``logits.float()`` (the matmuls stay in the model's dtype); float64 for gradcheck.
    """

    chunk_size: int = 1024
    vocab_chunk_size: int = 2048
    temperature: float = 1.0
    entropy: bool = False
    label_smoothing: bool = False
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.vocab_chunk_size < 1:
            raise ValueError(
                f"HeadSettings: chunk sizes must be >= 1, got {self.chunk_size} tokens x "
                f"{self.vocab_chunk_size} vocabulary rows"
            )
        if not self.temperature > 0:
            raise ValueError(f"HeadSettings: temperature must be > 0, got {self.temperature}")


class TokenScores(NamedTuple):
    """Per target position (0 where the target is ignored), in ``HeadSettings.dtype`` (fp32):
    ``logp`` (with gradient), ``entropy`` (with gradient; None unless asked) and
    ``smooth`` (mean over the vocabulary of ``-log p``, with gradient; None unless asked)."""

    logp: Tensor
    entropy: Tensor | None = None
    smooth: Tensor | None = None


class ProductTerms(Protocol):
    """A head layer whose output (no bias) is ``sum_i x_i @ w_i.T`` over its
    ``product_terms(x)`` (``astrai.model.layers.Linear``; a LoRA-wrapped head adds its
    low-rank pair)."""

    def product_terms(self, x: Tensor) -> list[tuple[Tensor, Tensor]]: ...


def local_rows(weight: Tensor) -> Tensor:
    """The head rows this process holds: a DTensor's local shard, else the tensor itself."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _blocks(n: int, size: int) -> list[tuple[int, int]]:
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _logits(xs: tuple[Tensor, ...], ws: tuple[Tensor, ...], rows: slice, cols: slice) -> Tensor:
    """One block of raw logits ``sum_i x_i[rows] @ w_i[cols].T``."""
    out = xs[0][rows] @ ws[0][cols].T
    for x, w in zip(xs[1:], ws[1:]):
        out = out + x[rows] @ w[cols].T
    return out


def _rescale(sums: Tensor, old: Tensor, new: Tensor) -> None:
    """In place: ``(sum exp(z - old), sum exp(z - old) * (z - old))`` re-expressed relative to
    ``new >= old`` (``old = -inf``: nothing summed yet)."""
    scale = torch.exp(old - new)
    shift = torch.where(torch.isfinite(old), old - new, 0.0)
    sums[1] = scale * (sums[1] + sums[0] * shift)
    sums[0] = scale * sums[0]


class _Plan(NamedTuple):
    settings: HeadSettings
    shard: VocabShard
    compute: torch.dtype  # HeadSettings.dtype


class _ChunkedHead(torch.autograd.Function):
    """``(plan, targets [N], x_1..x_k [N, D_i], w_1..w_k [V_local, D_i]) -> (logp [N],
    entropy [N] or empty, smooth [N] or empty)``; targets are global vocabulary ids."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, targets: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        k = len(tensors) // 2
        xs, ws = tensors[:k], tensors[k:]
        s, shard, dt = plan.settings, plan.shard, plan.compute
        n, v_local = targets.shape[0], ws[0].shape[0]
        dev = targets.device
        local = targets - shard.start  # the target's row among the local head rows
        m = torch.full((n,), -torch.inf, dtype=dt, device=dev)
        # per token, relative to its running max m: sum exp(z - m), sum exp(z - m) * (z - m)
        # (the entropy's, O(1) terms: no cancellation), the target's logit, sum z
        sums = torch.zeros(4, n, dtype=dt, device=dev)
        for r0, r1 in _blocks(n, s.chunk_size):
            rows = slice(r0, r1)
            for c0, c1 in _blocks(v_local, s.vocab_chunk_size):
                # at most two [tokens, vocab] blocks alive: the logits and their exponentials
                z = _logits(xs, ws, rows, slice(c0, c1)).to(dt).div_(s.temperature)
                col = local[rows] - c0
                hit = (col >= 0) & (col < c1 - c0)
                picked = z.gather(1, col.clamp(0, c1 - c0 - 1)[:, None])[:, 0]
                sums[2, rows] += torch.where(hit, picked, 0.0)
                if s.label_smoothing:
                    sums[3, rows] += z.sum(-1)
                new = torch.maximum(m[rows], z.amax(-1))
                _rescale(sums[:2, rows], m[rows], new)
                z = z.sub_(new[:, None])
                e = torch.exp(z)
                sums[0, rows] += e.sum(-1)
                if s.entropy:  # sum of e * (z - m) without a third block
                    sums[1, rows] += torch.bmm(e[:, None, :], z[:, :, None])[:, 0, 0]
                del e, z
                m[rows] = new
        top = shard.all_reduce_max(m)
        _rescale(sums[:2], m, top)
        counts = torch.full((1, n), float(v_local), dtype=dt, device=dev)
        total = shard.all_reduce_sum(torch.cat([sums, counts]))
        lse = top + torch.log(total[0])
        logp = total[2] - lse
        empty = logp.new_empty(0)
        entropy = torch.log(total[0]) - total[1] / total[0] if s.entropy else empty
        smooth = lse - total[3] / total[4] if s.label_smoothing else empty
        ctx.plan = plan
        ctx.vocab = total[4]
        ctx.save_for_backward(targets, lse, entropy, *tensors)
        return logp, entropy, smooth

    @staticmethod
    def backward(
        ctx: Any, g_logp: Tensor | None, g_entropy: Tensor | None, g_smooth: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        targets, lse, entropy, *tensors = ctx.saved_tensors
        k = len(tensors) // 2
        xs, ws = tensors[:k], tensors[k:]
        plan: _Plan = ctx.plan
        s, dt = plan.settings, plan.compute
        n, v_local = targets.shape[0], ws[0].shape[0]
        needs = ctx.needs_input_grad[2:]
        g_lp = g_logp.to(dt) if g_logp is not None else torch.zeros_like(lse)
        smoothing = s.label_smoothing and g_smooth is not None and g_smooth.numel() > 0
        g_sm = g_smooth.to(dt) if smoothing else None
        coef = g_sm - g_lp if g_sm is not None else -g_lp  # of softmax in d(out)/d(z)
        # the entropy's gradient (GRPO's entropy bonus): dH/dz = -p * (log p + H)
        g_h = None
        if s.entropy and g_entropy is not None and bool(g_entropy.any()):
            g_h = g_entropy.to(dt)
        local = targets - plan.shard.start
        gx = [
            torch.zeros(x.shape, dtype=torch.promote_types(dt, x.dtype), device=x.device)
            if need
            else None
            for x, need in zip(xs, needs[:k])
        ]
        gw = [torch.empty_like(w) if need else None for w, need in zip(ws, needs[k:])]
        # gradients accumulate over blocks in fp32 at least (a bf16 model's too)
        for c0, c1 in _blocks(v_local, s.vocab_chunk_size):
            cols = slice(c0, c1)
            acc = [
                torch.zeros(w[cols].shape, dtype=torch.promote_types(dt, w.dtype), device=w.device)
                if g is not None
                else None
                for w, g in zip(ws, gw)
            ]
            for r0, r1 in _blocks(n, s.chunk_size):
                rows = slice(r0, r1)
                # one [tokens, vocab] block, updated in place into the logits' gradient
                grad = _logits(xs, ws, rows, cols).to(dt).div_(s.temperature)
                grad.sub_(lse[rows, None])  # log p
                if g_h is None:
                    grad.exp_().mul_(coef[rows, None])  # softmax * coef
                else:  # p * coef - g_h * p * (log p + H)
                    p = torch.exp(grad)
                    grad.add_(entropy[rows, None]).mul_(-g_h[rows, None]).add_(coef[rows, None])
                    grad.mul_(p)
                    del p
                if g_sm is not None:
                    grad.sub_((g_sm[rows] / ctx.vocab[rows])[:, None])
                col = local[rows] - c0
                hit = (col >= 0) & (col < c1 - c0)
                onehot = torch.where(hit, g_lp[rows], 0.0)[:, None]
                grad.scatter_add_(1, col.clamp(0, c1 - c0 - 1)[:, None], onehot)
                grad = grad.div_(s.temperature).to(xs[0].dtype)
                for i in range(k):
                    if gx[i] is not None:
                        gx[i][rows] += grad @ ws[i][cols]
                    if acc[i] is not None:
                        acc[i] += grad.T @ xs[i][rows]
            for i in range(k):
                if gw[i] is not None:
                    gw[i][cols] = acc[i]
        grads_x = [
            plan.shard.all_reduce_sum(g).to(x.dtype) if g is not None else None
            for g, x in zip(gx, xs)
        ]
        return (None, None, *grads_x, *gw)


def chunked_token_scores(
    xs: list[Tensor] | tuple[Tensor, ...],
    ws: list[Tensor] | tuple[Tensor, ...],
    targets: Tensor,
    settings: HeadSettings,
    shard: VocabShard | None = None,
) -> TokenScores:
    """Scores ``[N]`` of the logits ``sum_i xs[i] @ ws[i].T`` (``xs[i]`` ``[N, D_i]``, ``ws[i]``
    the local head rows ``[V_local, D_i]``) at ``targets [N]`` (global vocabulary ids, all
    valid), computed block by block (module docstring)."""
    if len(xs) != len(ws) or not xs:
        raise ValueError("chunked_token_scores: one weight per input, at least one")
    plan = _Plan(settings, shard if shard is not None else VocabShard(), settings.dtype)
    logp, entropy, smooth = _ChunkedHead.apply(plan, targets, *xs, *ws)
    return TokenScores(
        logp,
        entropy if settings.entropy else None,
        smooth if settings.label_smoothing else None,
    )


@torch.compiler.disable
def head_scores(
    head: ProductTerms,
    hidden: Tensor,
    targets: Tensor,
    settings: HeadSettings,
    shard: VocabShard,
) -> TokenScores:
    """:class:`TokenScores` ``[B, S]`` of the final-normed ``hidden [B, S, D]`` under ``head``
    at ``targets [B, S]``; only positions whose target is not ``IGNORE_INDEX`` go through the
    head (0 elsewhere). Eager under ``torch.compile`` (its blocks have data-dependent sizes)."""
    keep = targets != IGNORE_INDEX
    terms = head.product_terms(hidden[keep])
    xs = [x for x, _ in terms]
    ws = [local_rows(w) for _, w in terms]
    flat = chunked_token_scores(xs, ws, targets[keep], settings, shard)

    def spread(t: Tensor | None) -> Tensor | None:
        if t is None:
            return None
        return t.new_zeros(targets.shape).masked_scatter(keep, t)

    return TokenScores(spread(flat.logp), spread(flat.entropy), spread(flat.smooth))
