"""GRPO's training forwards padding-free and by token budget.

Rollouts are prompt + completion sequences of very different lengths; right-padded to the
longest, most of a micro-batch can be padding. ``padding_free`` (TRL's name) packs the real
tokens of a micro-batch's sequences into one row whose position ids restart at 0 for every
sequence, so the model attends within each sequence only (``astrai.model.documents``: per
document span, no ``[S, S]`` mask) and computes no pad token. ``use_dynamic_bsz`` with
``ppo_max_token_len_per_gpu`` (verl's names and meaning: a forward holds at most that many
tokens) splits the micro-batch's sequences, in order, into packed rows of at most that budget,
one forward each; with more than one row and gradients on, each row's forward is recomputed
in the backward (``torch.utils.checkpoint``), so the activations held at once are one row's
rather than the whole micro-batch's, at the cost of one more forward.

What the model returns per packed token is scattered back to the right-padded ``[N, S, ...]``
layout (0 on padding), where the old log-probs, advantages, masks, importance weights and the
reference cache of :mod:`~astrai.train.strategies.grpo.generation` are aligned: the loss, its
aggregation (every ``loss_type``, the dapo normaliser over the optimizer step) and the
micro-steps (``steps_per_generation``, Lightning's accumulation) are those of the padded
layout; only the forwards change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# verl's default ppo_max_token_len_per_gpu
DEFAULT_TOKEN_BUDGET = 16384


class PaddedRows:
    """The right-padded layout: one forward over the ``[N, S]`` rows (no position ids: each
    row starts at 0, and right padding never changes a real token under causal attention)."""

    def apply(
        self,
        model: Callable[..., Any],
        input_ids: Tensor,
        per_token: Mapping[str, Tensor],
        kwargs: Mapping[str, Any],
    ) -> Any:
        return model(input_ids, **per_token, **kwargs)


class PackedRows:
    """Sequences of ``lengths`` (rows of a right-padded ``[N, S]`` batch) packed, ``groups``
    of consecutive rows ``[start, end)`` per forward."""

    def __init__(self, lengths: Sequence[int], width: int, groups: list[tuple[int, int]]) -> None:
        self.lengths = [int(n) for n in lengths]
        self.width = int(width)
        self.groups = groups

    def apply(
        self,
        model: Callable[..., Any],
        input_ids: Tensor,
        per_token: Mapping[str, Tensor],
        kwargs: Mapping[str, Any],
    ) -> Any:
        """``model``'s outputs on the packed rows, scattered back to ``[N, S, ...]``; every
        ``per_token`` tensor (``[N, S]``, e.g. targets) is packed like the ids."""
        device = input_ids.device
        cols = torch.arange(self.width, device=device)
        lengths = torch.tensor(self.lengths, device=device)
        keep_all = cols < lengths[:, None]
        call = model
        if len(self.groups) > 1 and torch.is_grad_enabled():  # one row's activations at a time
            call = functools.partial(checkpoint, model, use_reentrant=False)
        pieces = []
        for start, end in self.groups:
            keep = keep_all[start:end]
            packed = {k: v[start:end][keep][None] for k, v in per_token.items()}
            position_ids = cols.expand_as(keep)[keep][None]
            out = call(
                input_ids[start:end][keep][None], position_ids=position_ids, **packed, **kwargs
            )
            pieces.append(_scatter(out, keep))
        return _join(pieces)


RowLayout = PaddedRows | PackedRows


def _scatter(out: Any, keep: Tensor) -> Any:
    """``[1, T, ...]`` packed outputs (a tensor, or a tuple of tensors / None) back to the
    ``[n, S, ...]`` rows that ``keep`` marks (0 elsewhere)."""
    if isinstance(out, tuple | list):
        return _rebuild(out, [_scatter(o, keep) for o in out])
    if out is None:
        return None
    values = out[0]
    mask = keep.view(*keep.shape, *([1] * (values.dim() - 1)))
    shape = (*keep.shape, *values.shape[1:])
    return values.new_zeros(shape).masked_scatter(mask.expand(shape), values)


def _rebuild(like: tuple | list, items: list[Any]) -> Any:
    """``items`` in ``like``'s container type (a list, a tuple, or a named tuple such as the
    head's ``TokenScores``, whose constructor takes the fields one by one)."""
    kind = type(like)
    return kind(items) if kind in (tuple, list) else kind(*items)


def _join(pieces: list[Any]) -> Any:
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    if isinstance(first, tuple | list):
        return _rebuild(first, [_join([p[i] for p in pieces]) for i in range(len(first))])
    if first is None:
        return None
    return torch.cat(pieces)


@dataclass(frozen=True)
class RowPacking:
    """How a micro-batch's sequences are laid out for the forward (GRPO's ``padding_free``,
    ``use_dynamic_bsz`` and ``ppo_max_token_len_per_gpu``)."""

    padding_free: bool = False
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = DEFAULT_TOKEN_BUDGET
    #: the number of forwards every rank runs, from this rank's (the largest over the ranks:
    #: under FSDP2 each forward is a collective, as verl makes its micro-batch counts equal
    #: over data-parallel ranks); one process: its own
    agree: Callable[[int], int] = field(default=int, compare=False)

    @classmethod
    def parse(
        cls,
        padding_free: Any = False,
        use_dynamic_bsz: Any = False,
        ppo_max_token_len_per_gpu: Any = DEFAULT_TOKEN_BUDGET,
        *,
        max_new_tokens: int,
    ) -> RowPacking:
        """Checked; every error names its key (``strategy.<name>``)."""
        for name, value in (("padding_free", padding_free), ("use_dynamic_bsz", use_dynamic_bsz)):
            if not isinstance(value, bool):
                raise ValueError(f"GRPO {name} must be true or false, got {value!r}")
        budget = ppo_max_token_len_per_gpu
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(
                f"GRPO ppo_max_token_len_per_gpu (tokens per forward) must be an int >= 1, "
                f"got {budget!r}"
            )
        if use_dynamic_bsz and not padding_free:
            raise ValueError(
                "GRPO use_dynamic_bsz packs micro-batches by token budget: it needs "
                "padding_free=true (the packed rows it fills)"
            )
        if use_dynamic_bsz and budget <= max_new_tokens:
            raise ValueError(
                f"GRPO ppo_max_token_len_per_gpu={budget} cannot hold one sequence: it must "
                f"exceed max_new_tokens={max_new_tokens} (a prompt plus a full completion)"
            )
        return cls(bool(padding_free), bool(use_dynamic_bsz), int(budget))

    def layout(self, lengths: Sequence[int], width: int) -> RowLayout:
        """The layout of rows of ``lengths`` tokens (right-padded to ``width``)."""
        if not self.padding_free:
            return PaddedRows()
        if not self.use_dynamic_bsz:
            return PackedRows(lengths, width, [(0, len(lengths))])
        groups = token_groups(lengths, self.ppo_max_token_len_per_gpu)
        return PackedRows(lengths, width, spread_groups(groups, self.agree(len(groups))))


def token_groups(lengths: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` ranges of ``lengths``, each summing to at most ``budget``
    (a new range starts when the next sequence would not fit)."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(
                f"GRPO ppo_max_token_len_per_gpu={budget}: a sequence of {n} tokens (prompt + "
                "completion) does not fit one forward; raise it"
            )
        if total + n > budget:
            groups.append((start, i))
            start, total = i, 0
        total += n
    if start < len(lengths):
        groups.append((start, len(lengths)))
    return groups


def spread_groups(groups: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """``groups`` with the one of most sequences split in two until there are ``count``
    (each part stays within the budget its group kept). Every rank holds as many sequences
    per micro-batch, so a rank that packed into fewer forwards can always match another's."""
    groups = list(groups)
    while len(groups) < count:
        i = max(range(len(groups)), key=lambda j: groups[j][1] - groups[j][0])
        start, end = groups[i]
        if end - start < 2:
            raise RuntimeError(
                f"GRPO use_dynamic_bsz: {count} forwards asked of a micro-batch of "
                f"{groups[-1][1]} sequences (the ranks hold different numbers of rollouts)"
            )
        middle = (start + end) // 2
        groups[i : i + 1] = [(start, middle), (middle, end)]
    return groups


#: the right-padded layout (the default)
PADDED = RowPacking()
