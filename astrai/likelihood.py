"""Log-likelihoods of token sequences under a model, the one home of what training and
evaluation both compute: the per-token log-prob (`token_logprobs`), a response's summed or
averaged log-prob (`sequence_logprobs`), the log-probs of preference batches (``chosen_*`` /
``rejected_*``, see ``PreferenceDataset``: `preference_logprobs`) and a reward model's inputs
(`reward_inputs`). The preference strategies (``astrai.train.preference``) and
``astrai.eval.preference`` import them from here: evaluation never imports training."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.data.datasets import IGNORE_INDEX

__all__ = [
    "REDUCTIONS",
    "ld_masks",
    "preference_logprobs",
    "preference_token_logprobs",
    "reduce_preference",
    "reward_inputs",
    "sequence_logprobs",
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
    model: nn.Module, batch: Mapping[str, Tensor], *, padding_free: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs ``[2B, S]`` of the chosen rows then the rejected rows (0 off the
    response) and the response mask ``[2B, S]`` (bool), in one forward.

    ``padding_free`` packs the real tokens of the ``2B`` rows into one row with position ids
    restarting at 0 per sequence (the model attends within each sequence only), so no pad
    token is computed; the result is scattered back to the padded layout.
    """
    ids, labels = _sides(batch, "input_ids"), _sides(batch, "labels")
    mask = _sides(batch, "loss_mask").bool() & (labels != IGNORE_INDEX)
    if not padding_free:
        # Right padding under a causal mask never changes the logits of real tokens, so no
        # attention mask is needed (and SDPA keeps its fast causal path).
        return token_logprobs(model(ids), labels), mask
    keep = _sides(batch, "attention_mask").bool()
    positions = (keep.long().cumsum(-1) - 1)[keep]
    logits = model(ids[keep][None], position_ids=positions[None])
    packed = token_logprobs(logits, labels[keep][None])[0]
    return packed.new_zeros(ids.shape).masked_scatter(keep, packed), mask


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
) -> tuple[Tensor, Tensor]:
    """Response log-probs ``(chosen [B], rejected [B])`` (summed, averaged or LD-weighted,
    see :func:`reduce_preference`) in one ``[2B, S]`` forward (or one packed row)."""
    tok, mask = preference_token_logprobs(model, batch, padding_free=padding_free)
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
