"""Mixture-of-experts MLP: a top-k router, stacked SwiGLU experts and optional shared experts.

One module covers Mixtral, Qwen2-MoE / Qwen3-MoE and DeepSeek V2 / V3 routing (softmax or
sigmoid scores, greedy / group-limited / aux-free top-k with a correction bias, renormalised and
scaled weights). Experts are stored stacked (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`,
the layout transformers 5 keeps in memory), and tokens are dispatched by sorting the (token,
slot) pairs by expert, computing each expert's end offset on device and running both products
as one `torch._grouped_mm` each over the contiguous slices (no host sync: a `.tolist()` of the
offsets would stall the GPU once per layer; torch's CUDA kernel is sync-free for bf16 on sm90 /
sm100, its fallback for other dtypes / GPUs reads the offsets itself); small batches (decode,
CUDA-graph capture) gather
each pair's expert weights instead, also with no host sync. `_grouped_mm` wants 16-byte
aligned rows (hidden and expert sizes a multiple of 16 / element size); other sizes take the
gathered path at every batch size. In the engine's batch-invariant mode
(`astrai.extension.invariance`) the router's and each expert's products run in fixed row
blocks, one expert at a time (its loop reads the offsets on the host), and every batch takes
that path, so a token's output does not depend on the other tokens of the step.

GPT-OSS's experts (`expert_bias`, `swiglu_limit`) add a bias to both products and use a
clamped SwiGLU (`astrai.model.moe_activation`) on every one of these paths; its router has a
bias (`router_bias`).

In training each layer records its router statistics (Switch-Transformer load-balancing loss,
router z-loss, tokens per expert) of the latest forward; `router_stats(model)` collects them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from astrai.extension import batch_invariant_enabled, invariant_rows
from astrai.model.config import ModelConfig
from astrai.model.layers import MLP, Linear
from astrai.model.moe_activation import expert_activation, swiglu
from astrai.model.moe_config import expert_size, shared_size

__all__ = [
    "Experts",
    "MoE",
    "Router",
    "RouterStats",
    "SharedExpert",
    "inactive_expert_parameters",
    "make_mlp",
    "router_losses",
    "router_stats",
]

#: Batches with at most this many (token, expert) pairs gather expert weights per pair.
GATHER_MAX_PAIRS = 32


@dataclass
class RouterStats:
    """One MoE layer's routing in its latest training forward.

    `aux_loss` = num_experts * sum_e f_e * P_e (f_e: share of the token-slots routed to e,
    P_e: mean router probability of e); `z_loss` = mean logsumexp(logits)^2; both carry
    gradients. `expert_counts` ([E], detached) sums to tokens * num_experts_per_tok.
    """

    layer_id: int
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    expert_counts: torch.Tensor

    def load_cv(self) -> torch.Tensor:
        """Coefficient of variation (std / mean) of the tokens per expert: 0 is a perfect balance."""
        counts = self.expert_counts.float()
        return counts.std(unbiased=False) / counts.mean().clamp_min(1e-9)


class Router(nn.Module):
    """Scores experts and picks `num_experts_per_tok` of them per token.

    `weight` is `[E, H]` (HF's `mlp.gate.weight`); `e_score_correction_bias` (DeepSeek V3)
    shifts only the choice, not the weights, and is a buffer: aux-free balancing updates it
    outside the optimizer. `bias` (GPT-OSS's `router.bias`) is part of the logits.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.scoring = config.router_scoring
        self.method = config.router_topk_method
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scale = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.router_correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        else:
            self.e_score_correction_bias = None
        self.bias = nn.Parameter(torch.empty(config.num_experts)) if config.router_bias else None

    def reset_parameters(self, std: float, generator: torch.Generator | None = None) -> None:
        self.weight.data.normal_(0.0, std, generator=generator)
        if self.bias is not None:
            self.bias.data.normal_(0.0, std, generator=generator)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.zero_()

    def _group_mask(self, choice: torch.Tensor) -> torch.Tensor:
        """Boolean `[T, E]`: experts inside each token's `topk_group` best groups."""
        t = choice.shape[0]
        grouped = choice.view(t, self.n_group, -1)
        if self.method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        return keep[:, :, None].expand_as(grouped).reshape(t, -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`[T, H]` -> fp32 logits `[T, E]`, weights `[T, k]` (fp32) and expert ids `[T, k]`."""
        weight = self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        logits = invariant_rows(x.float(), lambda z: F.linear(z, weight, bias))
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        if self.method == "greedy":
            weights, ids = scores.topk(self.top_k, dim=-1)
        else:
            choice = scores
            if self.e_score_correction_bias is not None:
                choice = scores + self.e_score_correction_bias.float()
            fill = float("-inf") if self.method == "noaux_tc" else 0.0
            choice = choice.masked_fill(~self._group_mask(choice), fill)
            ids = choice.topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        return logits, weights, ids


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs stacked into two tensors (HF transformers 5's layout).

    GPT-OSS's variant: `bias` adds `gate_up_proj_bias [E, 2I]` / `down_proj_bias [E, H]` to
    the two products, and `activation` is its clamped SwiGLU (`astrai.model.moe_activation`).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        bias: bool = False,
        activation: Callable[[torch.Tensor], torch.Tensor] = swiglu,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None

    def reset_parameters(self, std: float, generator: torch.Generator | None = None) -> None:
        self.gate_up_proj.data.normal_(0.0, std, generator=generator)
        self.down_proj.data.normal_(0.0, std, generator=generator)
        if self.gate_up_proj_bias is not None and self.down_proj_bias is not None:
            self.gate_up_proj_bias.data.zero_()  # as transformers' GPT-OSS initialises them
            self.down_proj_bias.data.zero_()

    @staticmethod
    def _biased(h: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        """`h` plus each row's expert bias (`ids`: the expert of each row); `h` without one."""
        return h if bias is None else h + bias[ids].to(h.dtype)

    def _aligned(self, x: torch.Tensor) -> bool:
        """Whether `_grouped_mm` accepts these row strides (multiples of 16 bytes)."""
        sizes = (self.gate_up_proj.shape[2], self.down_proj.shape[2])
        return all(n * x.element_size() % 16 == 0 for n in sizes)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs per (token, slot) pair in expert order, and that order (flat pair index):
        two grouped matmuls over the expert-sorted pairs, offsets found on device."""
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        xs = x[order // ids.shape[1]]
        experts = torch.arange(self.num_experts, device=flat.device, dtype=flat.dtype)
        ids_sorted = flat[order]
        ends = torch.searchsorted(ids_sorted, experts, right=True).to(torch.int32)
        h = torch._grouped_mm(xs, self.gate_up_proj.to(x.dtype).transpose(1, 2), offs=ends)
        act = self.activation(self._biased(h, self.gate_up_proj_bias, ids_sorted))
        out = torch._grouped_mm(act, self.down_proj.to(x.dtype).transpose(1, 2), offs=ends)
        return self._biased(out, self.down_proj_bias, ids_sorted), order

    def _sorted(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch-invariant mode: one expert at a time in fixed row blocks (a host read of the
        offsets per layer, which that mode accepts)."""
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        xs = x[order // ids.shape[1]]
        ends = torch.bincount(flat, minlength=self.num_experts).cumsum(0).tolist()
        outs, start = [], 0
        for e, end in enumerate(ends):  # a loop over experts, each on a contiguous slice
            if end > start:
                gate_up, down = self.gate_up_proj[e], self.down_proj[e]
                b_up = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
                b_down = None if self.down_proj_bias is None else self.down_proj_bias[e]
                h = invariant_rows(xs[start:end], lambda z, w=gate_up, b=b_up: F.linear(z, w, b))
                act = self.activation(h)
                outs.append(invariant_rows(act, lambda z, w=down, b=b_down: F.linear(z, w, b)))
            start = end
        return torch.cat(outs), order

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Outputs `[T*k, H]` in pair order via per-pair weight gathers (static shapes)."""
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(ids.shape[1], dim=0)[:, :, None]
        h = self._biased(
            torch.bmm(self.gate_up_proj[flat], xs).squeeze(-1), self.gate_up_proj_bias, flat
        )
        out = torch.bmm(self.down_proj[flat], self.activation(h)[:, :, None]).squeeze(-1)
        return self._biased(out, self.down_proj_bias, flat)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`sum_j weights[t, j] * expert_{ids[t, j]}(x[t])` for `[T, H]` tokens."""
        t, k = ids.shape
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        invariant = batch_invariant_enabled()
        small = capturing or t * k <= GATHER_MAX_PAIRS or not self._aligned(x)
        if small and not invariant:  # its pair sum is in slot order
            out = self._gathered(x, ids) * weights.reshape(-1, 1).to(x.dtype)
            return out.view(t, k, -1).sum(1)
        out, order = self._sorted(x, ids) if invariant else self._grouped(x, ids)
        out = out * weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, order // k, out)


class SharedExpert(MLP):
    """The always-on SwiGLU expert(s) (DeepSeek's `shared_experts`, Qwen2-MoE's `shared_expert`)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        nn.Module.__init__(self)
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act = F.silu  # experts are SwiGLU (gemma_config refuses another hidden_act)


class MoE(nn.Module):
    """Routed experts plus optional shared expert(s) (with Qwen2-MoE's sigmoid gate)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.gate = Router(config)
        self.experts = Experts(
            config.num_experts,
            config.hidden_size,
            expert_size(config),
            bias=config.expert_bias,
            activation=expert_activation(config),
        )
        self.shared_expert = (
            SharedExpert(config.hidden_size, shared_size(config))
            if config.num_shared_experts
            else None
        )
        self.shared_expert_gate = (
            Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate else None
        )
        self.stats: RouterStats | None = None

    def __getstate__(self) -> dict:
        # The latest statistics hang on the autograd graph: copies and pickles leave them out
        # (deepcopy of a non-leaf tensor fails, e.g. exporting a LoRA copy after a step).
        return {**super().__getstate__(), "stats": None}

    def reset_parameters(self, std: float, generator: torch.Generator | None = None) -> None:
        """Router and stacked experts (the shared expert's Linears are initialised as any)."""
        self.gate.reset_parameters(std, generator)
        self.experts.reset_parameters(std, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Any `[..., H]` (dense `[B, S, H]` in training, packed `[T, H]` in the engine)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits, weights, ids = self.gate(flat)
        out = self.experts(flat, ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        if self.training and torch.is_grad_enabled():
            self.stats = self._statistics(logits, ids)
        return out.view(shape)

    def _statistics(self, logits: torch.Tensor, ids: torch.Tensor) -> RouterStats:
        probs = logits.softmax(-1)
        flat = ids.reshape(-1)  # scatter_add, not bincount: CUDA's bincount reads max() on host
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        counts = counts.scatter_add_(0, flat, torch.ones_like(flat))
        frac = counts.float() / ids.numel()
        aux = self.num_experts * (frac * probs.mean(0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        return RouterStats(self.layer_id, aux, z, counts.detach())


def make_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
    """The feed-forward of block `layer_id`: a `MoE` where the config routes, else the dense MLP."""
    return MoE(config, layer_id) if config.is_moe_layer(layer_id) else MLP(config)


def inactive_expert_parameters(model: nn.Module) -> int:
    """Routed-expert parameters a token does not run: (E - k) / E of every MoE layer's experts.
    `num_parameters() - this` is the active count that sets the FLOPs per token."""
    total = 0
    for m in model.modules():
        if isinstance(m, MoE):
            per_expert = sum(p.numel() for p in m.experts.parameters()) // m.num_experts
            total += (m.num_experts - m.top_k) * per_expert
    return total


def router_stats(model: nn.Module) -> list[RouterStats]:
    """The statistics every MoE layer of `model` recorded in its latest training forward."""
    return [m.stats for m in model.modules() if isinstance(m, MoE) and m.stats is not None]


def router_losses(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mean over MoE layers of (load-balancing loss, z-loss); None when nothing was routed."""
    stats = router_stats(model)
    if not stats:
        return None
    aux = torch.stack([s.aux_loss for s in stats]).mean()
    z = torch.stack([s.z_loss for s in stats]).mean()
    return aux, z
