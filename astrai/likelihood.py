"""Log-likelihoods of token sequences under a model, the one home of what training and
evaluation both compute: the per-token log-prob (`token_logprobs` from logits; a model's
per-token scores through the LM head, dense or chunked: `DenseHead` / `ChunkedHead`,
`logits_head`), a response's summed or
averaged log-prob (`sequence_logprobs`), the log-probs of preference batches (``chosen_*`` /
``rejected_*``, see ``PreferenceDataset``: `preference_logprobs`) and a reward model's inputs
(`reward_inputs`). The preference strategies (``astrai.train.preference``) and
``astrai.eval.preference`` import them from here: evaluation never imports training."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from astrai.data.datasets import IGNORE_INDEX
from astrai.model.head import HeadSettings, TokenScores
from astrai.vocab_parallel import vocab_parallel_scores

__all__ = [
    "CHUNKED",
    "DEFAULT_LOGITS_CHUNK_SIZE",
    "REDUCTIONS",
    "ChunkedHead",
    "DenseHead",
    "LogitsHead",
    "TokenScores",
    "check_chunk_size",
    "check_liger_kernel",
    "ld_masks",
    "logits_head",
    "next_token_targets",
    "preference_logprobs",
    "preference_token_logprobs",
    "reduce_preference",
    "reward_inputs",
    "scores_loss",
    "sequence_logprobs",
    "token_entropy",
    "token_logprobs",
]

REDUCTIONS = ("sum", "mean")


def token_logprobs(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """`log p(targets[b, t])` under `logits[b, t]`: `[B, S, V], [B, S] -> [B, S]` in fp32,
    0 where `targets == ignore_index`. For next-token log-probs of a sequence pass
    `logits[:, :-1], input_ids[:, 1:]`.

    `cross_entropy(reduction="none")` rather than `log_softmax` + gather: no second
    `[B, S, V]` tensor is materialised.
    """
    nll = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index, reduction="none"
    )
    return -nll.view_as(targets)


class _TokenEntropy(torch.autograd.Function):
    """Entropy of each masked position's distribution, chunk by chunk; the backward
    recomputes each chunk's softmax (``dH/dz = -p * (log p + H)``), so nothing of size
    ``[positions, V]`` is kept for it."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, mask: Tensor, chunk: int) -> Tensor:
        out = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
        where = mask.bool().nonzero(as_tuple=True)
        rows = logits[where]
        values = []
        for start in range(0, rows.shape[0], chunk):
            logp = torch.log_softmax(rows[start : start + chunk].float(), dim=-1)
            values.append(-(logp.exp() * logp).sum(-1))
        if values:
            out[where] = torch.cat(values)
        ctx.chunk = chunk
        ctx.save_for_backward(logits, mask, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        logits, mask, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        out = torch.zeros_like(logits)
        where = mask.bool().nonzero(as_tuple=True)
        rows, h, g = logits[where], entropy[where], grad[where]
        parts = []
        for start in range(0, rows.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            logp = torch.log_softmax(rows[part].float(), dim=-1)
            dz = -logp.exp() * (logp + h[part, None]) * g[part, None]
            parts.append(dz.to(logits.dtype))
        if parts:
            out[where] = torch.cat(parts)
        return out, None, None


def token_entropy(logits: Tensor, mask: Tensor, chunk: int = 1024) -> Tensor:
    """Entropy of each position's distribution ``[N, T, V] -> [N, T]`` (fp32; with gradient:
    GRPO's entropy bonus), computed only where ``mask`` is set (0 elsewhere) and ``chunk``
    positions at a time, so no second ``[N, T, V]`` tensor exists."""
    return _TokenEntropy.apply(logits, mask, chunk)


#: tokens per block of the chunked LM head when a strategy does not say
#: (`strategy.logits_chunk_size`; docs/benchmarks.md "Chunked LM head" chose it)
DEFAULT_LOGITS_CHUNK_SIZE = 1024


def check_chunk_size(chunk_size: int) -> int:
    """`strategy.logits_chunk_size` must be an int >= 1 (null: the dense path)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"strategy.logits_chunk_size: tokens per chunk of the LM head must be an int >= 1 "
            f"(null: the full logits), got {chunk_size!r}"
        )
    return chunk_size


class DenseHead:
    """``strategy.logits_chunk_size: null``: the model's full logits ``[B, S, V]``, then the
    per-token scores from them (the reference the chunked path is tested against)."""

    def scores(
        self,
        model: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        *,
        temperature: float = 1.0,
        entropy: bool = False,
        label_smoothing: bool = False,
        **forward: Tensor | None,
    ) -> TokenScores:
        """`TokenScores` ``[B, S]`` of ``targets`` (``IGNORE_INDEX``: 0) under ``model``'s
        logits divided by ``temperature``; ``forward``: the model's other arguments
        (``position_ids``, ``attention_mask``)."""
        logits = model(input_ids, **forward)
        if isinstance(logits, DTensor):  # tensor parallelism: each rank's vocabulary rows
            return vocab_parallel_scores(
                logits,
                targets,
                temperature=temperature,
                entropy=entropy,
                label_smoothing=label_smoothing,
            )
        if temperature != 1.0:
            logits = logits.float() / temperature
        keep = targets != IGNORE_INDEX
        smooth = None
        if label_smoothing:
            smooth = -torch.log_softmax(logits.float(), -1).mean(-1) * keep
        return TokenScores(
            token_logprobs(logits, targets),
            token_entropy(logits, keep) if entropy else None,
            smooth,
        )


class ChunkedHead:
    """``strategy.logits_chunk_size: n``: the LM head applied ``n`` target tokens at a time
    inside the model's forward (:mod:`astrai.model.head`), never the full logits."""

    def __init__(self, chunk_size: int = DEFAULT_LOGITS_CHUNK_SIZE) -> None:
        self.chunk_size = check_chunk_size(chunk_size)

    def scores(
        self,
        model: nn.Module,
        input_ids: Tensor,
        targets: Tensor,
        *,
        temperature: float = 1.0,
        entropy: bool = False,
        label_smoothing: bool = False,
        **forward: Tensor | None,
    ) -> TokenScores:
        """As :meth:`DenseHead.scores`, through ``model(..., targets=, head=)``."""
        settings = HeadSettings(
            self.chunk_size,
            temperature=temperature,
            entropy=entropy,
            label_smoothing=label_smoothing,
        )
        return model(input_ids, targets=targets, head=settings, **forward)


LogitsHead = DenseHead | ChunkedHead
#: the default of the functions below (and of every strategy): chunked
CHUNKED = ChunkedHead()


def check_liger_kernel(use_liger_kernel: bool) -> None:
    """``strategy.use_liger_kernel`` (TRL's name): Liger's fused linear losses need CUDA and the
    ``liger-kernel`` package; refused, naming the key, where either is missing, and refused
    where both are present too: that backend is not wired into the strategies (the chunked
    torch head, ``strategy.logits_chunk_size``, is the supported path on every device)."""
    if not use_liger_kernel:
        return
    if not torch.cuda.is_available():
        why = "the Liger fused linear losses run on CUDA only and this process sees no CUDA device"
    elif importlib.util.find_spec("liger_kernel") is None:
        why = "the liger-kernel package is not installed (pip install liger-kernel)"
    else:
        why = "the Liger backend is not wired into astrai's strategies"
    raise ValueError(
        f"strategy.use_liger_kernel: {why}; set strategy.use_liger_kernel=false (the chunked "
        "head, strategy.logits_chunk_size, keeps the full logits out of memory everywhere)"
    )


def logits_head(
    chunk_size: int | None = DEFAULT_LOGITS_CHUNK_SIZE, use_liger_kernel: bool = False
) -> LogitsHead:
    """The head path of ``strategy.logits_chunk_size`` (None: dense) and
    ``strategy.use_liger_kernel``, checked (before any model is built)."""
    check_liger_kernel(use_liger_kernel)
    return DenseHead() if chunk_size is None else ChunkedHead(chunk_size)


def scores_loss(
    scores: TokenScores, labels: Tensor, *, label_smoothing: float = 0.0
) -> tuple[Tensor, Tensor]:
    """:func:`lm_loss` from per-token scores (the chunked head's, or the dense ones): the mean
    over labelled tokens of ``(1 - eps) * -log p + eps * mean_v(-log p_v)`` (torch's
    ``cross_entropy(label_smoothing=eps)``), and their count."""
    n = (labels != IGNORE_INDEX).sum()
    per_token = -scores.logp
    if label_smoothing:
        per_token = (1.0 - label_smoothing) * per_token + label_smoothing * scores.smooth
    return per_token.sum() / n, n


def next_token_targets(input_ids: Tensor, mask: Tensor | None = None) -> Tensor:
    """``[B, S]`` targets of next-token scores: ``input_ids[:, t + 1]`` at ``t`` (where
    ``mask [B, S-1]`` is set, when given), ``IGNORE_INDEX`` elsewhere and at the last column;
    a model's scores at them, ``[:, :-1]``, align with ``input_ids[:, 1:]``."""
    nxt = input_ids[:, 1:]
    if mask is not None:
        nxt = nxt.masked_fill(~mask.bool(), IGNORE_INDEX)
    return torch.cat([nxt, nxt.new_full((nxt.shape[0], 1), IGNORE_INDEX)], dim=1)


def sequence_logprobs(token_logps: Tensor, mask: Tensor, reduction: str = "sum") -> Tensor:
    """Sum (``reduction="sum"``) or mean (``"mean"``) of per-token log-probs over the masked
    (response) tokens: ``[B, S] -> [B]``; an empty response gives 0."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    mask = mask.to(token_logps.dtype)
    total = (token_logps * mask).sum(-1)
    return total if reduction == "sum" else total / mask.sum(-1).clamp(min=1.0)


def _sides(batch: Mapping[str, Tensor], key: str) -> Tensor:
    return torch.cat([batch[f"chosen_{key}"], batch[f"rejected_{key}"]])


def preference_token_logprobs(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    *,
    padding_free: bool = False,
    head: LogitsHead = CHUNKED,
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs ``[2B, S]`` of the chosen rows then the rejected rows (0 off the
    response) and the response mask ``[2B, S]`` (bool), in one forward.

    ``padding_free`` packs the real tokens of the ``2B`` rows into one row with position ids
    restarting at 0 per sequence (the model attends within each sequence only), so no pad
    token is computed; the result is scattered back to the padded layout. ``head``: dense
    logits or the chunked head (only the response tokens go through it).
    """
    ids, labels = _sides(batch, "input_ids"), _sides(batch, "labels")
    mask = _sides(batch, "loss_mask").bool() & (labels != IGNORE_INDEX)
    targets = labels.masked_fill(~mask, IGNORE_INDEX)
    if not padding_free:
        # Right padding under a causal mask never changes the logits of real tokens, so no
        # attention mask is needed (and SDPA keeps its fast causal path).
        return head.scores(model, ids, targets).logp, mask
    keep = _sides(batch, "attention_mask").bool()
    positions = (keep.long().cumsum(-1) - 1)[keep]
    packed = head.scores(model, ids[keep][None], targets[keep][None], position_ids=positions[None])
    return packed.logp[0].new_zeros(ids.shape).masked_scatter(keep, packed.logp[0]), mask


def ld_masks(mask: Tensor) -> tuple[Tensor, Tensor]:
    """LD-DPO's split of the response masks ``[2B, S]`` (chosen rows, then rejected): the
    first ``min(n_chosen, n_rejected)`` response tokens of each row (shared) and the rest of
    the longer response (tail)."""
    counts = mask.sum(-1)
    b = counts.shape[0] // 2
    shared = torch.minimum(counts[:b], counts[b:]).repeat(2)[:, None]
    rank = mask.long().cumsum(-1)
    return mask & (rank <= shared), mask & (rank > shared)


def reduce_preference(
    token_logps: Tensor, mask: Tensor, reduction: str = "sum", ld_alpha: float | None = None
) -> tuple[Tensor, Tensor]:
    """Sequence log-probs ``(chosen [B], rejected [B])`` of :func:`preference_token_logprobs`'
    output: summed or averaged over the response, or LD-DPO's ``shared + ld_alpha * tail``
    (``ld_alpha`` needs ``reduction="sum"``)."""
    if ld_alpha is None:
        seq = sequence_logprobs(token_logps, mask, reduction)
    else:
        if reduction != "sum":
            raise ValueError("DPO ld_alpha weights summed log-probs: it needs reduction=sum")
        shared, tail = ld_masks(mask)
        seq = sequence_logprobs(token_logps, shared) + ld_alpha * sequence_logprobs(
            token_logps, tail
        )
    b = seq.shape[0] // 2
    return seq[:b], seq[b:]


def preference_logprobs(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    reduction: str = "sum",
    *,
    ld_alpha: float | None = None,
    padding_free: bool = False,
    head: LogitsHead = CHUNKED,
) -> tuple[Tensor, Tensor]:
    """Response log-probs ``(chosen [B], rejected [B])`` (summed, averaged or LD-weighted,
    see :func:`reduce_preference`) in one ``[2B, S]`` forward (or one packed row)."""
    tok, mask = preference_token_logprobs(model, batch, padding_free=padding_free, head=head)
    return reduce_preference(tok, mask, reduction, ld_alpha)


def reward_inputs(batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Chosen then rejected sequences ``[2B, S']`` of a preference batch, each up to its
    last assistant token, and the index of that token per row ``[2B]``.

    The batch's ``*_input_ids`` stop one token short of the document (``labels`` are shifted
    by one), so the last assistant token is put back from ``labels``; a row without any
    labelled token is scored at its last real token. Columns after the last scored token
    are dropped; right padding is harmless under the causal mask.
    """
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    attn = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
    n, s = ids.shape
    cols = torch.arange(s, device=ids.device).expand(n, s)
    labelled = labels != IGNORE_INDEX
    t = torch.where(labelled, cols, -1).amax(-1)  # the last labelled position, -1 if none
    has = t >= 0
    rows = torch.arange(n, device=ids.device)
    full = torch.cat([ids, ids.new_zeros(n, 1)], dim=1)
    full[rows[has], t[has] + 1] = labels[rows[has], t[has]]
    last = torch.where(has, t + 1, attn.sum(-1) - 1)
    return full[:, : int(last.max()) + 1], last
