"""Where this process's share of the vocabulary lies, for the losses over the LM head.

The chunked head (:mod:`astrai.model.head`) computes log-sum-exp, target logits and entropy
over the head rows it holds; every reduction across the vocabulary goes through a
:class:`VocabShard`, so the same code serves the whole vocabulary on one process (this class,
the no-op) and a head split by vocabulary rows over a tensor-parallel group (a subclass that
all-reduces over that group).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["VocabShard"]


class VocabShard:
    """The whole vocabulary on this process: the local head rows start at id 0 and nothing
    needs reducing across processes."""

    #: first vocabulary id of the local head rows
    start: int = 0

    def all_reduce_max(self, t: Tensor) -> Tensor:
        """Element-wise max over the processes sharing the vocabulary (identity here)."""
        return t

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        """Element-wise sum over the processes sharing the vocabulary (identity here)."""
        return t
