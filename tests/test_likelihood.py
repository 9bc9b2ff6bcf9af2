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
