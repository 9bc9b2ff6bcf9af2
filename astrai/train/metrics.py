"""Tokenizer-independent language-model metrics: perplexity, bits per byte, a unigram baseline.

Cross entropy in nats per token depends on the tokenizer (a larger vocabulary packs more
text into a token); bits per byte does not: the same total nats divided by ``ln 2`` times the
UTF-8 bytes the target tokens stand for. Both are corpus-level here: sums over every target
token of the evaluation pass, not a mean of batch means.

* :class:`CorpusNLL`: the running sums (nats, tokens, bytes);
  :func:`astrai.tokenizer.bytes.corpus_metrics` turns them into ``ppl`` and ``bpb``, with
  :func:`astrai.tokenizer.bytes.token_byte_lengths` (bytes each token id stands for).
* :class:`ValidationCorpusMetrics`: mixin for an ``LMModule`` that logs ``val/ppl`` and
  ``val/bpb`` once per validation epoch (summed over DDP ranks).
* :func:`unigram_baseline`: the same figures for add-one-smoothed token frequencies of the
  training split, the floor a trained model must beat (``python -m astrai.train.unigram``
  computes it for a training config).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.data.datasets import IGNORE_INDEX
from astrai.tokenizer.bytes import corpus_metrics, token_byte_lengths

log = logging.getLogger(__name__)

__all__ = [
    "CorpusNLL",
    "ValidationCorpusMetrics",
    "dataset_targets",
    "unigram_baseline",
]


class CorpusNLL:
    """Running sums of an evaluation pass: nats over all target tokens, their count, and the
    bytes they stand for (``byte_lengths``, e.g. :func:`token_byte_lengths`; ``None``: no
    bytes, no bpb). Reset it at the start of a pass, read ``totals()`` at the end."""

    def __init__(self, byte_lengths: Tensor | None = None, ignore_index: int = IGNORE_INDEX):
        self.byte_lengths = byte_lengths
        self.ignore_index = ignore_index
        self.reset()

    def reset(self) -> None:
        self.nats = 0.0
        self.tokens = 0
        self.bytes = 0

    @torch.no_grad()
    def update(self, logits: Tensor, labels: Tensor) -> None:
        """Add a batch: ``logits [..., V]`` and ``labels [...]`` (already shifted, positions
        equal to ``ignore_index`` skipped). Plain cross entropy: no label smoothing."""
        nats = F.cross_entropy(
            logits.float().flatten(0, -2),
            labels.flatten(),
            ignore_index=self.ignore_index,
            reduction="none",
        )
        self.update_nll(nats.view_as(labels), labels)

    @torch.no_grad()
    def update_nll(self, nll: Tensor, labels: Tensor) -> None:
        """Add a batch from its per-token negative log-likelihoods ``nll [...]`` (what the
        chunked LM head gives, no logits needed) at ``labels [...]``; positions equal to
        ``ignore_index`` are skipped."""
        keep = labels != self.ignore_index
        self.nats += float(nll.detach().float()[keep].sum())
        self.tokens += int(keep.sum())
        if self.byte_lengths is not None:
            if self.byte_lengths.device != labels.device:
                self.byte_lengths = self.byte_lengths.to(labels.device)
            self.bytes += int(self.byte_lengths[labels[keep]].sum())

    def totals(self) -> Tensor:
        """``[nats, tokens, bytes]`` as float64, ready to be summed across ranks."""
        return torch.tensor([self.nats, self.tokens, self.bytes], dtype=torch.float64)


class ValidationCorpusMetrics:
    """Mixin for an ``LMModule`` strategy: logs ``val/ppl`` and ``val/bpb`` over the whole
    validation epoch, summed across DDP ranks before the division.

    Use as ``class MyModule(ValidationCorpusMetrics, LMModule)`` and call
    ``self.tally_validation(nll, labels)`` (per-token negative log-likelihoods, e.g. the
    chunked head's ``-logp``) in ``compute_loss`` (it does nothing outside
    ``validation_step``), so validation still runs one forward per batch. Bytes come from
    the module's tokenizer (no tokenizer: ``val/ppl`` only). A DDP validation sampler that
    pads the last batch with repeated samples counts those twice, as ``val/loss`` does.
    """

    val_nll: CorpusNLL | None = None
    _tallying: bool = False

    def tally_validation(self, nll: Tensor, labels: Tensor) -> None:
        if not self._tallying:
            return
        if self.val_nll is None:
            tok = self.tokenizer
            size = self.model.config.vocab_size
            self.val_nll = CorpusNLL(token_byte_lengths(tok, size) if tok is not None else None)
        self.val_nll.update_nll(nll, labels)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self._tallying = True
        try:
            return super().validation_step(batch, batch_idx)
        finally:
            self._tallying = False

    def on_validation_epoch_start(self) -> None:
        super().on_validation_epoch_start()
        if self.val_nll is not None:
            self.val_nll.reset()

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if self.val_nll is None:
            return
        totals = self.val_nll.totals()
        trainer = self.trainer
        if trainer.world_size > 1:
            totals = trainer.strategy.reduce(totals.to(self.device), reduce_op="sum").cpu()
        for key, value in corpus_metrics(*totals.tolist()).items():
            # already summed over ranks: the same value everywhere, no further sync
            self.log(f"val/{key}", value, sync_dist=False)


# ---------------------------------------------------------------------- unigram baseline
def dataset_targets(dataset: Any) -> Iterator[Tensor]:
    """The target tokens of every sample (its ``labels`` other than ``IGNORE_INDEX``): what
    the loss of a model is computed on, in dataset order."""
    for i in range(len(dataset)):
        labels = torch.as_tensor(dataset[i]["labels"]).flatten()
        yield labels[labels != IGNORE_INDEX]


def _counts(targets: Iterable[Tensor], size: int) -> Tensor:
    counts = torch.zeros(size, dtype=torch.float64)
    for t in targets:
        counts += torch.bincount(t.long(), minlength=size)[:size].double()
    return counts


def unigram_baseline(
    train: Iterable[Tensor], val: Iterable[Tensor], byte_lengths: Tensor
) -> dict[str, float]:
    """Cross entropy of add-one-smoothed unigram frequencies on the validation targets.

    ``p(v) = (count_train(v) + 1) / (N_train + V)`` with ``V = len(byte_lengths)`` (the
    tokenizer's vocabulary), scored on every validation target token. Returns ``nats``,
    ``tokens``, ``bytes`` (sums), ``nats_per_token``, ``ppl`` and ``bpb`` (as
    :func:`corpus_metrics`, with the same byte table as the model's ``val/bpb``).
    """
    size = len(byte_lengths)
    train_counts = _counts(train, size)
    val_counts = _counts(val, size)
    logp = torch.log((train_counts + 1.0) / (train_counts.sum() + size))
    nats = float(-(val_counts * logp).sum())
    tokens = float(val_counts.sum())
    num_bytes = float((val_counts * byte_lengths.double()).sum())
    out = {
        "nats": nats,
        "tokens": tokens,
        "bytes": num_bytes,
        "train_tokens": float(train_counts.sum()),
    }
    out["nats_per_token"] = nats / tokens if tokens else float("nan")
    out.update(corpus_metrics(nats, tokens, num_bytes))
    return out
