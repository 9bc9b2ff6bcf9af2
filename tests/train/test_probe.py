"""`astrai.train.probe`: conditions, probe specs, and the teacher-forced log-prob probe against
a plain-torch computation."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from astrai.train.probe import (
    CallableProbe,
    Condition,
    EvalProbe,
    LogprobProbe,
    ProbeError,
    parse_probe,
)


def test_conditions_parse_and_hold():
    c = Condition.parse("exact_match < 0.5")
    assert (c.metric, c.op, c.value, c.sign) == ("exact_match", "<", 0.5, -1)
    assert c.holds({"arithmetic/exact_match": 0.25, "arithmetic/format": 1.0})
    assert not c.holds({"arithmetic/exact_match": 0.5})
    assert not c.holds({"arithmetic/exact_match": float("nan")})
    assert Condition.parse("arithmetic/format>=1").holds({"arithmetic/format": 1.0})
    assert Condition.parse("x != 2").sign == 0
    with pytest.raises(ProbeError, match="metric op number"):
        Condition.parse("exact_match is low")
    with pytest.raises(ProbeError, match="'low' is not a number"):
        Condition.parse("exact_match < low")
    with pytest.raises(ProbeError, match="ambiguous"):
        c.key({"a/exact_match": 1.0, "b/exact_match": 0.0})


def test_probe_specs():
    cfg = OmegaConf.create({"arithmetic": {"max_operand": 9}})
    assert isinstance(parse_probe("eval=[arithmetic]", cfg), EvalProbe)
    assert isinstance(parse_probe("logprob=builtin:arithmetic/sft/val", cfg), LogprobProbe)
    assert isinstance(parse_probe("os.path:join", cfg), CallableProbe)
    with pytest.raises(ProbeError, match=r"probe=no\.such\.module:fn"):
        parse_probe("no.such.module:fn", cfg)
    with pytest.raises(ProbeError, match="give eval="):
        parse_probe("what", cfg)


class _Policy:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def live_policy(self):
        return self.model, self.tokenizer


def test_logprob_probe_equals_plain_torch(stdlib_tokenizer):
    """The probe's mean log-prob of the answers equals log_softmax of the logits at the
    assistant tokens, computed here record by record from the chat template's text."""
    from astrai.data.builtin import builtin_records
    from astrai.model import preset_model

    torch.manual_seed(0)
    model = preset_model("tiny", vocab_size=len(stdlib_tokenizer))
    probe = LogprobProbe("builtin:arithmetic/sft/val", {"n": 4, "seed": 1}, limit=4)
    got = probe(_Policy(model, stdlib_tokenizer), stdlib_tokenizer)
    total, count, sums = 0.0, 0, []
    for rec in builtin_records("arithmetic/sft/val", n=4, seed=1):
        prompt = stdlib_tokenizer.apply_chat_template(
            rec["messages"][:-1], add_generation_prompt=True, tokenize=True
        )
        full = stdlib_tokenizer.apply_chat_template(rec["messages"], tokenize=True)
        logits = model(torch.tensor([full]))[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        # what SFT trains on: the assistant's answer and its end-of-turn token
        end = full.index(stdlib_tokenizer.token_to_id("<|im_end|>"), len(prompt))
        answer = range(len(prompt), end + 1)
        picked = [float(logp[i - 1, full[i]]) for i in answer]
        sums.append(sum(picked))
        total, count = total + sum(picked), count + len(picked)
    assert got["logprob_sum"] == pytest.approx(sum(sums) / len(sums), rel=1e-9)
    assert got["logprob"] == pytest.approx(total / count, rel=1e-9)
