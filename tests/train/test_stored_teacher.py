"""The stored top-k teacher (offline distillation): its divergence against a plain-torch
reference written from the definition, TRL's top-k forward KL (``ServerDistillationTrainer``,
trl 1.16 ``trl/experimental/server_distillation/server_distillation_trainer.py``,
``_compute_server_forward_kl_loss``) and, with ``k = V``, TRL's full-vocabulary GKD loss
(``GKDTrainer.generalized_jsd_loss``, ``trl/experimental/gkd/gkd_trainer.py``); and how it
reads the batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from astrai.data.teacher_topk import TOPK_IDS, TOPK_LOGPROBS
from astrai.train.strategies.distill.stored_teacher import StoredTopKTeacher, topk_divergence
from astrai.train.strategies.distill.teacher import DistillLoss

pytestmark = pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")

V, N = 11, 7


def _case(k: int, seed: int = 0, dtype: torch.dtype = torch.float64):
    g = torch.Generator().manual_seed(seed)
    student = (2 * torch.randn(N, V, generator=g, dtype=dtype)).requires_grad_(True)
    teacher = F.log_softmax(2 * torch.randn(N, V, generator=g, dtype=dtype), dim=-1)
    logprobs, ids = teacher.topk(k, dim=-1)
    return student, ids, logprobs, teacher


def _reference(student, ids, logprobs, beta: float, temperature: float, add_tail: bool):
    """The definition, one position and one bucket at a time, in probabilities."""
    losses = []
    for i in range(student.shape[0]):
        s_all = torch.softmax(student[i] / temperature, dim=-1)
        s = [s_all[j] for j in ids[i].tolist()]
        t = [torch.exp(a) for a in logprobs[i]]
        if add_tail:  # the rest of each distribution's mass as one more outcome
            s.append(1 - sum(s))
            t.append(1 - sum(t))
        else:  # both renormalised over the ids; the teacher's tempered first
            t = [x ** (1 / temperature) for x in t]
            s = [x / sum(s) for x in s]
            t = [x / sum(t) for x in t]
        total = 0.0
        for p, q in zip(t, s):
            m = beta * p + (1 - beta) * q
            if beta == 0:
                total = total + p * torch.log(p / q)
            elif beta == 1:
                total = total + q * torch.log(q / p)
            else:
                total = total + beta * p * torch.log(p / m) + (1 - beta) * q * torch.log(q / m)
        losses.append(total)
    return torch.stack(losses)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize(("add_tail", "temperature"), [(True, 1.0), (False, 1.0), (False, 0.7)])
@pytest.mark.parametrize("k", [1, 3])
def test_divergence_equals_the_definition(beta, add_tail, temperature, k):
    student, ids, logprobs, _ = _case(k, seed=k)
    loss = DistillLoss(beta=beta, temperature=temperature)
    ours = topk_divergence(student, ids, logprobs, loss, add_tail=add_tail)
    (grad,) = torch.autograd.grad(ours.sum(), student)
    ref = _reference(student, ids, logprobs, beta, temperature, add_tail)
    (ref_grad,) = torch.autograd.grad(ref.sum(), student)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-10)
    if k == 1 and not add_tail:  # one renormalised outcome: nothing to learn (TRL's tail note)
        assert ours.abs().max() < 1e-12
    else:
        assert ours.min() > 0


@pytest.mark.parametrize("add_tail", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_beta_zero_is_trl_top_k_forward_kl(add_tail, k):
    """TRL's own code: ``_compute_server_forward_kl_loss`` (batchmean over label positions)."""
    from trl.experimental.server_distillation.server_distillation_trainer import (
        ServerDistillationTrainer as Server,
    )

    student, ids, logprobs, _ = _case(k, seed=10 + k)
    labels = torch.tensor([[5, -100, 3, 2, -100, 7, 1]])  # [B=1, T=N]
    fake = SimpleNamespace(
        loss_add_tail=add_tail, _reduce_divergence_loss=Server._reduce_divergence_loss
    )
    result = {"topk_logprobs": logprobs[None], "topk_token_ids": ids[None]}
    trl_loss = Server._compute_server_forward_kl_loss(
        fake, result, F.log_softmax(student, dim=-1)[None], labels
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, student)
    keep = labels[0] != -100
    per_pos = topk_divergence(student, ids, logprobs, DistillLoss(beta=0.0), add_tail=add_tail)
    ours = per_pos[keep].mean()
    (grad,) = torch.autograd.grad(ours, student)
    torch.testing.assert_close(ours, trl_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize(("add_tail", "temperature"), [(False, 0.7), (False, 1.0), (True, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_support_is_trl_gkd(beta, add_tail, temperature, dtype):
    """k = V: the stored path is the live one, TRL's ``generalized_jsd_loss`` (1e-6)."""
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    student, ids, logprobs, teacher = _case(V, seed=3, dtype=dtype)
    labels = torch.tensor([[4, 2, -100, 9, 0, -100, 6]])
    trl_loss = GKDTrainer.generalized_jsd_loss(
        student[None], teacher[None], labels=labels, beta=beta, temperature=temperature
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, student)
    loss = DistillLoss(beta=beta, temperature=temperature)
    keep = labels[0] != -100
    ours = topk_divergence(student, ids, logprobs, loss, add_tail=add_tail)[keep].mean()
    (grad,) = torch.autograd.grad(ours, student)
    torch.testing.assert_close(ours, trl_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=1e-6)
    assert trl_loss > 1e-2  # not a trivially equal pair of zeros


def test_scores_read_the_batch_at_flat_positions():
    """Positions index ``[N, S - 1]``; the module may pass the dataset's ``input_ids`` or the
    full sequences (one longer): entry ``j`` is the target ``j + 1`` either way."""
    b, length, k = 2, 5, 3
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, V, (b, length), generator=g),
        "attention_mask": torch.ones(b, length, dtype=torch.long),
        TOPK_IDS: torch.randint(0, V, (b, length, k), generator=g),
        TOPK_LOGPROBS: -torch.rand(b, length, k, generator=g, dtype=torch.float64) - 1.5,
    }
    full = torch.cat([batch["input_ids"], torch.zeros(b, 1, dtype=torch.long)], dim=1)
    student = torch.randn(3, V, generator=g, dtype=torch.float64)
    loss = DistillLoss(beta=0.5)
    for sequences, width in ((full, length), (batch["input_ids"], length - 1)):
        scores = StoredTopKTeacher().score(sequences, batch)
        positions = torch.tensor([0, width + 1, 2 * width - 1])  # (0, 0), (1, 1), (1, last)
        rows, cols = positions // width, positions % width
        got = scores.divergence(positions, student, torch.zeros(3, dtype=torch.long), loss)
        want = topk_divergence(
            student, batch[TOPK_IDS][rows, cols], batch[TOPK_LOGPROBS][rows, cols], loss
        )
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_refusals():
    teacher = StoredTopKTeacher()
    assert teacher.loss_types == ("gkd",)
    with pytest.raises(ValueError, match=r"reverse_kl.*live teacher"):
        teacher.check(DistillLoss(loss_type="reverse_kl"))
    with pytest.raises(ValueError, match=r"temperature=0\.9.*loss_add_tail"):
        teacher.check(DistillLoss(temperature=0.9))
    StoredTopKTeacher(loss_add_tail=False).check(DistillLoss(temperature=0.9))
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match=r"teacher_topk_ids.*teacher_top_k"):
        teacher.score(ids, {"input_ids": ids})
    batch = {
        "input_ids": ids,
        "attention_mask": torch.tensor([[1, 1, 1, 0]]),
        TOPK_IDS: torch.zeros(1, 4, 2, dtype=torch.long),
        TOPK_LOGPROBS: torch.full((1, 4, 2), -math.log(2)),
    }
    teacher.score(torch.tensor([[1, 2, 3, 9]]), batch)  # differs only under padding
    with pytest.raises(ValueError, match=r"rows \[0\].*lmbda must be 0"):
        teacher.score(torch.tensor([[1, 2, 5, 4]]), batch)  # a generated completion
    with pytest.raises(ValueError, match="does not cover"):
        teacher.score(torch.tensor([[1, 2, 3, 4, 5, 6]]), batch)
