"""On-policy distillation (GKD, Agarwal et al. 2024; TRL's ``GKDTrainer``): the student learns
the teacher's next-token distributions on SFT-kind data (prompt + completion, labels on the
completion).

Per training micro-batch, with probability ``lmbda`` (a draw from a seeded generator whose state
is in the checkpoint, so resume and replay decide alike) the micro-batch is on-policy: the
student completes each document's prompt through the run's policy engine on the live weights
(GRPO's :class:`~astrai.train.strategies.grpo.engine_source.EngineSource`, with GRPO's seed
scheme, so the step ledger records the samples and a replay replays them); else the dataset's
own completions are used. The student runs once to its final-normed hidden states; the
completion positions go through its LM head one chunk (``strategy.logits_chunk_size``) at a
time under ``torch.utils.checkpoint``, so neither model's ``[N, S, V]`` logits are ever held,
and each chunk's loss comes from the teacher's :class:`~astrai.train.strategies.distill.
teacher.TeacherScores`. The loss is the mean over the micro-batch's trained positions (TRL's
``batchmean`` with labels).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from astrai.inference import InferenceEngine
from astrai.likelihood import DEFAULT_LOGITS_CHUNK_SIZE
from astrai.train.module import LMModule
from astrai.train.policy_engine import PolicyEngine
from astrai.train.strategies.distill.losses import token_logp
from astrai.train.strategies.distill.options import DistillOptions, make_teacher
from astrai.train.strategies.distill.sequences import (
    Sequences,
    dataset_sequences,
    prompts_of,
    student_sequences,
)
from astrai.train.strategies.distill.teacher import TeacherScores
from astrai.train.strategies.grpo.engine_source import EngineSource
from astrai.train.strategies.grpo.source import RolloutModule, RolloutSource, rollout_index

log = logging.getLogger(__name__)

__all__ = ["DistillModule"]


def _student_vocab_size(model: Any) -> int:
    """The student's vocabulary size without allocating it (a factory built on meta)."""
    if isinstance(model, torch.nn.Module):
        return int(model.config.vocab_size)
    return int(model(device="meta").config.vocab_size)


class DistillModule(RolloutModule, LMModule):
    """Distillation of a teacher into the policy (the student).

    Args:
        engine: the policy engine's factory (the ``engine`` group, as GRPO's), on which the
            student's on-policy completions are sampled.
        **kwargs: the options (:class:`~astrai.train.strategies.distill.options.
            DistillOptions`, checked, and the teacher's vocabulary, before any model is
            built) and ``LMModule``'s (``tokenizer`` required).
    """

    def __init__(self, *, engine: Callable[..., InferenceEngine] | None = None, **kwargs: Any):
        if kwargs.get("tokenizer") is None:
            raise ValueError("strategy=distill needs a tokenizer (the student's prompts)")
        mine, base = DistillOptions.split(kwargs)
        options = DistillOptions.parse(**mine)
        teacher = make_teacher(options, _student_vocab_size(base["model"]), base["tokenizer"])
        super().__init__(**base)
        self.options = options
        self.loss_spec = options.loss
        self.teacher = teacher  # a plain attribute: frozen, in no optimizer or checkpoint
        self.chunk_size: int | None = base.get("logits_chunk_size", DEFAULT_LOGITS_CHUNK_SIZE)
        self.policy_engine = PolicyEngine(self.live_policy, engine)
        self.source: RolloutSource = EngineSource(
            self.policy_engine, options.sampling, tokenizer=self.tokenizer, rewards=[]
        )
        # lmbda's draw, one per training micro-batch (the same on every rank)
        self.lmbda_generator = torch.Generator().manual_seed(options.rollout_seed)

    # ------------------------------------------------------------------ rollouts
    def wrap_source(self, wrap: Callable[[RolloutSource], RolloutSource]) -> None:
        self.source = wrap(self.source)

    def rollout_seed(self, count: int) -> int:
        """The seed of this micro-batch's ``count`` completions (GRPO's scheme with G = 1)."""
        return self.options.rollout_seed + rollout_index(self._trainer) * count

    def draw_on_policy(self) -> bool:
        """lmbda's draw for this micro-batch: ``u < lmbda`` for ``u`` uniform in [0, 1) (TRL
        GKD's ``random() <= lmbda`` but for the measure-zero ``u = 0``: lmbda 0 is never
        on-policy, 1 always)."""
        u = float(torch.rand((), generator=self.lmbda_generator))
        return u < self.options.lmbda

    def student_rollouts(self, batch: Mapping[str, Any]) -> Sequences:
        """The student's completions of the batch's prompts (from the source, seeded)."""
        prompts = prompts_of(batch)
        seed = self.rollout_seed(len(prompts))
        request = {"prompt_ids": prompts, "records": [{} for _ in prompts]}
        samples = self.source.take(request, seed, int(self.global_step))
        self.policy_engine.sleep()
        return student_sequences(samples, self._pad_id, self.device)

    @property
    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad) if pad is not None else 0

    # ------------------------------------------------------------------ loss
    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        on_policy = self.training and self.draw_on_policy()
        if on_policy:
            seqs = self.student_rollouts(batch)
        else:
            seqs = dataset_sequences(batch, self._pad_id)
        self.flops_per_batch = self.flops_per_token * seqs.input_ids.numel()
        loss, metrics = self.distill_loss(seqs, batch)
        metrics["distill/on_policy_frac"] = torch.tensor(float(on_policy))
        metrics["distill/completion_len"] = seqs.completion_lengths.mean()
        return loss, metrics

    def _chunk(
        self, hidden: Tensor, positions: Tensor, targets: Tensor, scores: TeacherScores
    ) -> tuple[Tensor, Tensor]:
        """One chunk: the student's logits (recomputed in backward when checkpointed), the
        teacher's per-position loss, the student's log-prob of the targets (no gradient)."""
        logits = self.model.lm_head(hidden)
        loss = scores.divergence(positions, logits, targets, self.loss_spec)
        logp = token_logp(logits.detach(), targets, self.loss_spec.temperature)
        return loss, logp

    def distill_loss(
        self, seqs: Sequences, batch: Mapping[str, Any]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The mean per-position loss over ``seqs.mask`` and the metrics."""
        scores = self.teacher.score(seqs.input_ids, batch)
        hidden = self.model(seqs.input_ids, return_hidden=True)
        flat = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        positions = seqs.mask.reshape(-1).nonzero()[:, 0]
        targets = seqs.input_ids[:, 1:].reshape(-1)[positions]
        n = int(positions.numel())
        size = self.chunk_size or max(n, 1)
        losses, logps = [], []
        for start in range(0, n, size):
            pos, tgt = positions[start : start + size], targets[start : start + size]
            if self.chunk_size is None:
                loss, logp = self._chunk(flat[pos], pos, tgt, scores)
            else:
                loss, logp = checkpoint(
                    self._chunk, flat[pos], pos, tgt, scores, use_reentrant=False
                )
            losses.append(loss)
            logps.append(logp)
        if not losses:  # nothing to train on: a zero that keeps the graph
            zero = flat.sum() * 0.0
            return zero, {"distill/loss": zero.detach()}
        total = torch.cat(losses).sum() / n
        metrics = {
            "distill/loss": total.detach(),
            "distill/student_logp": torch.cat(logps).mean(),
        }
        teacher_logp = [
            scores.target_logp(
                positions[s : s + size], targets[s : s + size], self.loss_spec.temperature
            )
            for s in range(0, n, size)
        ]
        if all(t is not None for t in teacher_logp):
            metrics["distill/teacher_logp"] = torch.cat(teacher_logp).mean()
        return total, metrics

    # ------------------------------------------------------------------ hooks
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        # new weights after an optimizer step: the engine's policy version follows (GRPO's)
        self.policy_engine.join(int(self.global_step))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["distill_lmbda_generator"] = self.lmbda_generator.get_state().tolist()
        checkpoint.update(self.source.state_dict())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("distill_lmbda_generator")
        if state is not None:
            self.lmbda_generator.set_state(torch.tensor(state, dtype=torch.uint8))
        self.source.load_state_dict(checkpoint)

    def teardown(self, stage: str) -> None:
        self.source.close()
        super().teardown(stage)
