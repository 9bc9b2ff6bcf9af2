"""Distillation's losses against their references: GKD's generalised JSD against TRL's own
``GKDTrainer.generalized_jsd_loss`` (trl 1.16, ``trl/experimental/gkd/gkd_trainer.py``, called
from the installed package), both the plain function and the module's chunked path (student
logits recomputed per chunk under ``torch.utils.checkpoint``, teacher logits per chunk from its
hidden states), loss and gradients to 1e-6; the token-level reverse KL against its definition
(value ``log p_s(y) - log p_t(y)``, gradient ``k * grad log p_s(y)``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.data.datasets import IGNORE_INDEX
from astrai.model import load_pretrained
from astrai.train.strategies.distill import DistillModule
from astrai.train.strategies.distill.losses import generalized_jsd, token_reverse_kl
from astrai.train.strategies.distill.sequences import dataset_sequences

pytestmark = pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")

CASES = [(beta, t) for beta in (0.0, 0.5, 1.0) for t in (0.7, 2.0)]


def trl_jsd():
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _logits(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(("beta", "temperature"), CASES)
def test_generalized_jsd_equals_trl(beta, temperature):
    """Ours (per position, then TRL's batchmean over labelled positions) equals TRL's loss and
    its gradient with respect to the student's logits."""
    b, s, v = 3, 5, 17
    student = _logits(0, (b, s, v)).requires_grad_(True)
    teacher = _logits(1, (b, s, v))
    labels = torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(2))
    labels[0, :2] = IGNORE_INDEX
    labels[2, 4] = IGNORE_INDEX
    ref = trl_jsd()(student, teacher, labels=labels, beta=beta, temperature=temperature)
    (g_ref,) = torch.autograd.grad(ref, student)
    keep = labels != IGNORE_INDEX
    ours = generalized_jsd(student[keep], teacher[keep], beta, temperature)
    ours = ours.sum() / keep.sum()
    (g_ours,) = torch.autograd.grad(ours, student)
    assert ref.item() > 1e-3  # a real divergence, not two equal distributions
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-6, rtol=1e-6)


def _module(student_dir, teacher_dir, chunk: int | None, **options) -> DistillModule:
    model = load_pretrained(student_dir, dtype=torch.float64).train()
    return DistillModule(
        model=model,
        tokenizer=str(student_dir),
        teacher_model_name_or_path=str(teacher_dir),
        logits_chunk_size=chunk,
        lmbda=0.0,
        **options,
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory, stdlib_tokenizer, save_model_dir):
    root = tmp_path_factory.mktemp("distill_pair")
    student = save_model_dir(root / "student", stdlib_tokenizer, seed=0)
    teacher = save_model_dir(root / "teacher", stdlib_tokenizer, seed=1)
    return student, teacher


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, vocab, (3, 12), generator=g)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for i, (start, end) in enumerate([(4, 12), (6, 10), (2, 12)]):
        labels[i, start:end] = torch.randint(5, vocab, (end - start,), generator=g)
        ids[i, start + 1 : end] = labels[i, start : end - 1]
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize(("beta", "temperature"), [(0.0, 0.7), (0.5, 2.0), (1.0, 0.7)])
def test_chunked_module_loss_equals_trl_on_full_logits(pair, beta, temperature):
    """The module's loss over a micro-batch (chunks of 5 positions under checkpointing) equals
    TRL's generalized_jsd_loss on the two models' full logits, and so do the student's
    parameter gradients."""
    student_dir, teacher_dir = pair
    module = _module(student_dir, teacher_dir, 5, beta=beta, temperature=temperature)
    module.teacher.model.double()
    batch = _batch(module.model.config.vocab_size)
    seqs = dataset_sequences(batch, 0)
    loss, metrics = module.distill_loss(seqs, batch)
    ours = torch.autograd.grad(loss, list(module.model.parameters()))

    ids = seqs.input_ids
    student_logits = module.model(ids)[:, :-1]
    with torch.no_grad():
        teacher_logits = module.teacher.model(ids)[:, :-1]
    labels = ids[:, 1:].masked_fill(~seqs.mask, IGNORE_INDEX)
    ref = trl_jsd()(
        student_logits, teacher_logits, labels=labels, beta=beta, temperature=temperature
    )
    theirs = torch.autograd.grad(ref, list(module.model.parameters()))
    assert ref.item() > 1e-4
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # the metrics: mean log-probs of the trained tokens at the temperature
    keep = labels != IGNORE_INDEX
    s_logp = F.log_softmax(student_logits / temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    t_logp = F.log_softmax(teacher_logits / temperature, -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(metrics["distill/student_logp"], s_logp[keep].mean().detach())
    torch.testing.assert_close(metrics["distill/teacher_logp"], t_logp[keep].mean())


def test_chunked_and_dense_paths_agree(pair):
    """logits_chunk_size null (all positions at once, no checkpoint) gives the same loss."""
    student_dir, teacher_dir = pair
    batch = None
    values = []
    for chunk in (None, 3):
        module = _module(student_dir, teacher_dir, chunk)
        batch = batch or _batch(module.model.config.vocab_size)
        values.append(module.distill_loss(dataset_sequences(batch, 0), batch)[0])
    torch.testing.assert_close(values[0], values[1], atol=1e-12, rtol=1e-12)


def test_token_reverse_kl_value_and_gradient():
    """Value: log p_s(y) - log p_t(y) at the sampled token (temperature-scaled); gradient:
    the score-function one, (log p_s(y) - log p_t(y)) * grad log p_s(y)."""
    n, v, t = 6, 13, 0.8
    student = _logits(4, (n, v)).requires_grad_(True)
    teacher = _logits(5, (n, v))
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(6))
    loss = token_reverse_kl(student, teacher, y, t)
    s = F.log_softmax(student / t, -1)[torch.arange(n), y]
    tt = F.log_softmax(teacher / t, -1)[torch.arange(n), y]
    torch.testing.assert_close(loss, (s - tt).detach(), atol=1e-12, rtol=0)
    (g,) = torch.autograd.grad(loss.sum(), student)
    (g_ref,) = torch.autograd.grad(((s - tt).detach() * s).sum(), student)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0)


def test_heads_see_one_chunk_at_a_time(pair):
    """Neither LM head is ever applied to more than logits_chunk_size positions at once (the
    [N, S, V] logits of either model never exist), in the forward and in the backward's
    recomputation; the student's head runs twice per chunk (checkpointed)."""
    student_dir, teacher_dir = pair
    module = _module(student_dir, teacher_dir, 4)
    batch = _batch(module.model.config.vocab_size)
    rows: dict[str, list[int]] = {"student": [], "teacher": []}
    for name, head in (
        ("student", module.model.lm_head),
        ("teacher", module.teacher.model.lm_head),
    ):
        head.register_forward_hook(
            lambda mod, args, out, name=name: rows[name].append(args[0].shape[0])
        )
    seqs = dataset_sequences(batch, 0)
    loss, _ = module.distill_loss(seqs, batch)
    loss.backward()
    n = int(seqs.mask.sum())
    chunks = -(-n // 4)
    assert max(rows["student"]) <= 4 and max(rows["teacher"]) <= 4
    assert len(rows["student"]) == 2 * chunks  # forward + the backward's recomputation
    assert sum(rows["student"]) == 2 * n
