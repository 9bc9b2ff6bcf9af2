"""`astrai.likelihood`: the log-probs training and evaluation share live below both.

The preference strategies and `python -m astrai.eval.preference` read the same functions
(one home), and evaluation never imports the training package (an import running back up
the floors)."""

from __future__ import annotations

import ast
import inspect

import torch
import torch.nn.functional as F

import astrai.eval.preference as eval_preference
import astrai.likelihood as likelihood
import astrai.train.module as module
import astrai.train.preference as train_preference


def test_token_logprobs_is_log_softmax_at_the_targets_and_zero_where_ignored():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    targets[1, 3] = -100
    got = likelihood.token_logprobs(logits, targets)
    want = F.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    want[1, 3] = 0.0
    torch.testing.assert_close(got, want)


def test_sequence_logprobs_sums_or_averages_over_the_mask():
    tok = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert likelihood.sequence_logprobs(tok, mask).tolist() == [-3.0, 0.0]
    assert likelihood.sequence_logprobs(tok, mask, "mean").tolist() == [-1.5, 0.0]


def test_training_and_evaluation_use_the_one_home():
    shared = set(likelihood.__all__) & set(train_preference.__all__)
    assert {"preference_logprobs", "reward_inputs", "sequence_logprobs"} <= shared
    for name in shared:
        assert getattr(train_preference, name) is getattr(likelihood, name), name
    assert module.token_logprobs is likelihood.token_logprobs


def test_evaluation_imports_nothing_from_training():
    tree = ast.parse(inspect.getsource(eval_preference))
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in (n.names if isinstance(n, ast.Import) else [None])
    ]
    assert "astrai.likelihood" in imported
    assert not [m for m in imported if m and m.startswith("astrai.train")], imported


def test_the_dense_entropy_has_the_gradient_of_autograd_in_float64():
    """`token_entropy` (chunked positions, the backward recomputing each chunk's softmax) has
    the value and gradient of autograd through ``-(p * log p).sum()``, 0 on masked-out
    positions: GRPO's entropy bonus on the dense head."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 37, generator=g, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]])
    coef = torch.randn(2, 5, generator=g)
    got = likelihood.token_entropy(logits, mask, chunk=3)
    (grad,) = torch.autograd.grad((got * coef).sum(), logits)
    ref_in = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(ref_in, -1)
    ref = -(logp.exp() * logp).sum(-1) * mask
    (want,) = torch.autograd.grad((ref * coef.double()).sum(), ref_in)
    torch.testing.assert_close(got.double(), ref.detach(), rtol=0.0, atol=1e-6)
    torch.testing.assert_close(grad.double(), want, rtol=0.0, atol=1e-6)
    assert bool((grad[mask == 0] == 0).all())
