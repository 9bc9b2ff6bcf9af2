"""Test-only bisect probes (`probe=_probes.NAME` with this folder on PYTHONPATH)."""

from __future__ import annotations

from typing import Any

import torch


def weight_norm(module: Any, tokenizer: Any) -> dict[str, float]:
    """The L2 norm of every weight of the policy, in float64: unchanged exactly while the
    weights are."""
    model, _ = module.live_policy()
    total = sum(float(p.detach().double().pow(2).sum()) for p in model.parameters())
    return {"norm": total**0.5}


def completion_logprob(pairs: list[tuple[list[int], list[int]]]) -> Any:
    """A probe: the mean log-prob the policy gives each completion after its prompt."""

    def probe(module: Any, tokenizer: Any) -> dict[str, float]:
        model, _ = module.live_policy()
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for prompt, completion in pairs:
                ids = torch.tensor([prompt + completion])
                logp = torch.log_softmax(model(ids).double(), dim=-1)[0]
                for i, token in enumerate(completion):
                    total += float(logp[len(prompt) + i - 1, token])
                    count += 1
        return {"logp": total / max(count, 1)}

    return probe
