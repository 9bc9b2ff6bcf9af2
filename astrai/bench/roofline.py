"""FLOPs of an engine step from the model's config, and a same-run matmul roofline to read
them against (issue #31: "achieved GFLOP/s and the fraction of a same-run matmul roofline").

`step_flops` counts the useful FLOPs (2 per multiply-add) of one packed forward as the engine
runs it: every projection each new token goes through (q/k/v/o, or MLA's projections with
the absorbed W_UK / W_UV products of its latent-space inference path; the MLP, or the MoE's
router, its `num_experts_per_tok` active experts, shared experts and their gate), the lm_head
for the rows that sample only (the engine computes no other logits), and attention's score
and value products over the keys each query sees (the causal triangle of a prefill). Norms,
RoPE, softmax, biases and sampling are not counted; nor is padding (MLA's padded decode).

`gemm_roofline` times those matmuls alone, as one step issues them: every product of the
model in order, with the model's own weight tensors (so a model larger than the CPU's cache
streams its weights as the step does) through the same routes (`astrai.extension.linear`
with each Linear's `cache_resident` flag, and the engine's packed q/k/v and gate/up
products while an engine has packed them; F.linear for the router and the experts, whose
tokens are spread evenly over as many experts as they fill; einsum for MLA's absorbed
products). Its GFLOP/s is what the step's matmuls reach with nothing else around them, so
achieved / roofline says how much of the matmul speed the rest of the step (attention,
norms, scheduling, Python) costs. `peak_gflops` is one large square GEMM, for context.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from astrai.extension import linear
from astrai.model.config import ModelConfig
from astrai.model.layers import Linear
from astrai.model.mla import MLAttention
from astrai.model.moe import MoE
from astrai.model.moe_config import expert_size, shared_size

PEAK_GEMM_SIZE = 1024  # `peak_gflops`' square GEMM: large enough to be compute-bound


# ---------------------------------------------------------------------- FLOPs
def _attention_projection_macs(config: ModelConfig) -> int:
    """Multiply-adds of one token through one layer's attention projections."""
    h, heads = config.hidden_size, config.num_attention_heads
    if config.attention_type != "mla":
        q, kv = heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return h * q + 2 * h * kv + q * h
    nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    rank = config.kv_lora_rank
    if config.q_lora_rank is None:
        query = h * heads * (nope + rope)
    else:
        query = h * config.q_lora_rank + config.q_lora_rank * heads * (nope + rope)
    # kv_a_proj_with_mqa, then the absorbed W_UK (query side) and W_UV (output side)
    latent = h * (rank + rope) + heads * nope * rank + heads * rank * v
    return query + latent + heads * v * h


def _mlp_macs(config: ModelConfig, layer_id: int) -> int:
    """Multiply-adds of one token through block `layer_id`'s feed-forward (active experts only)."""
    h = config.hidden_size
    if not config.is_moe_layer(layer_id):
        return 3 * h * config.intermediate_size
    macs = h * config.num_experts  # the router
    macs += config.num_experts_per_tok * 3 * h * expert_size(config)
    if config.num_shared_experts:
        macs += 3 * h * shared_size(config) + (h if config.shared_expert_gate else 0)
    return macs


def token_macs(config: ModelConfig) -> int:
    """Multiply-adds of the projections one new token goes through in all layers (the
    lm_head excluded: only sampling rows reach it)."""
    attn = _attention_projection_macs(config)
    return sum(attn + _mlp_macs(config, i) for i in range(config.num_hidden_layers))


def attention_macs_per_key(config: ModelConfig) -> int:
    """Multiply-adds of one query token against one key in one layer (scores + values):
    GQA `2 x heads x head_dim`; MLA in the latent space, `heads x (2 rank + rope)`."""
    heads = config.num_attention_heads
    if config.attention_type == "mla":
        return heads * (2 * config.kv_lora_rank + config.qk_rope_head_dim)
    return 2 * heads * config.head_dim


def visible_keys(q_len: int, kv_len: int) -> int:
    """Keys the `q_len` new tokens of a request attend to when it holds `kv_len` after the
    step: each sees the earlier context and itself (causal)."""
    if not 0 <= q_len <= kv_len:
        raise ValueError(f"need 0 <= q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2


def step_flops(
    config: ModelConfig, q_lens: Sequence[int], kv_lens: Sequence[int], sampled_rows: int
) -> dict[str, int]:
    """FLOPs (2 per multiply-add) of one packed forward: request `i` feeds `q_lens[i]` new
    tokens and holds `kv_lens[i]` after the step; `sampled_rows` of the new tokens go through
    the lm_head (the engine: one per sampling request; a dense forward: all). Returns
    `matmul` (projections and lm_head), `attention` (scores and values) and `total`."""
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"q_lens ({len(q_lens)}) and kv_lens ({len(kv_lens)}) differ in length")
    tokens = sum(q_lens)
    if not 0 <= sampled_rows <= tokens:
        raise ValueError(f"sampled_rows must lie in [0, {tokens}], got {sampled_rows}")
    keys = sum(visible_keys(q, kv) for q, kv in zip(q_lens, kv_lens, strict=True))
    head = sampled_rows * config.hidden_size * config.vocab_size
    matmul = 2 * (tokens * token_macs(config) + head)
    attention = 2 * config.num_hidden_layers * attention_macs_per_key(config) * keys
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


# ---------------------------------------------------------------------- measured roofline
@dataclass(frozen=True)
class Gemm:
    """One matmul of a step: `name`, its (rows, in, out) `shape` (per head for MLA's
    absorbed products, `heads` of them), FLOPs, and a call that runs it."""

    name: str
    shape: tuple[int, int, int]
    flops: int
    run: Callable[[], torch.Tensor]


def _spread(pairs: int, experts: int) -> list[int]:
    """Rows per expert when `pairs` (token, expert) pairs fill experts evenly."""
    used = min(experts, pairs)
    if used == 0:
        return []
    base, extra = divmod(pairs, used)
    return [base + (e < extra) for e in range(used)]


class _Inputs:
    """Random inputs by shape, made once (a fixed seed, the weights' device and dtype)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.made: dict[tuple[int, ...], torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self, *shape: int) -> torch.Tensor:
        if shape not in self.made:
            x = torch.randn(shape, generator=self.gen)
            self.made[shape] = x.to(self.device, self.dtype)
        return self.made[shape]


#: where an engine hangs a module's packed projections (`astrai.model.packed`: q/k/v and
#: gate/up as one product each while the engine lives)
PACK_ATTRIBUTES = ("packed_qkv", "packed_gate_up")


def _live_packs(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """The packed projections of `module` that still stand for its own Linears (a LoRA
    wrapper replacing one retires its pack), brought up to date with their weights."""
    children = {id(m) for m in module.children()}
    packs = []
    for attr in PACK_ATTRIBUTES:
        pack = getattr(module, attr, None)
        if pack is not None and all(id(m) in children for m in pack.sources):
            pack.refresh()  # a no-op unless a source weight changed since the last copy
            packs.append((attr, pack))
    return packs


def step_gemms(model: torch.nn.Module, rows: int, sampled_rows: int | None = None) -> list[Gemm]:
    """The matmuls of one engine step of `rows` new tokens (`sampled_rows` of them through the
    lm_head; default all), in model order, over the model's own weights (module docstring)."""
    sampled = rows if sampled_rows is None else sampled_rows
    if rows <= 0 or not 0 <= sampled <= rows:
        raise ValueError(f"need rows > 0 and 0 <= sampled_rows <= rows, got {rows}, {sampled}")
    head = getattr(model, "lm_head", None)
    ref = next(model.parameters())
    inputs = _Inputs(ref.device, ref.dtype)
    skip: set[int] = set()  # packed Linears; MLA's kv_b_proj (run as the absorbed products)
    gemms: list[Gemm] = []

    def add(name: str, shape: tuple[int, int, int], run: Callable[[], Any], times: int = 1):
        gemms.append(Gemm(name, shape, 2 * times * math.prod(shape), run))

    for name, mod in model.named_modules():
        for attr, pack in _live_packs(mod):  # one product for the Linears a pack stands for
            skip.update(id(m) for m in pack.sources)
            size = pack.sources[0].in_features
            out = sum(m.out_features for m in pack.sources)
            add(f"{name}.{attr}", (rows, size, out), partial(pack, inputs(rows, size)))
        if isinstance(mod, MLAttention):  # the absorbed products, batched over heads
            skip.add(id(mod.kv_b_proj))
            w_uk, w_uv = mod.absorbed()
            heads, nope, rank = w_uk.shape
            q, o = inputs(rows, heads, nope), inputs(rows, heads, rank)
            uk = partial(torch.einsum, "thn,hnr->thr", q, w_uk)
            add(f"{name}.w_uk", (rows, nope, rank), uk, heads)
            uv = partial(torch.einsum, "thr,hvr->thv", o, w_uv)
            add(f"{name}.w_uv", (rows, rank, w_uv.shape[1]), uv, heads)
        elif isinstance(mod, MoE):  # the router, then the routed experts' tokens, spread
            w = mod.gate.weight
            x = inputs(rows, w.shape[1])
            add(f"{name}.gate", (rows, *w.shape[::-1]), partial(F.linear, x.float(), w.float()))
            experts = mod.experts
            for e, n in enumerate(_spread(rows * mod.top_k, experts.num_experts)):
                for part in ("gate_up_proj", "down_proj"):
                    w = getattr(experts, part)[e]
                    x = inputs(n, w.shape[1])
                    add(f"{name}.experts.{e}.{part}", (n, *w.shape[::-1]), partial(F.linear, x, w))
        elif isinstance(mod, Linear) and id(mod) not in skip:
            n = sampled if mod is head else rows
            if n:
                x = inputs(n, mod.in_features)
                call = partial(mod, x)  # its own route: a prepacked weight while packed
                add(name, (n, mod.in_features, mod.out_features), call)
    return gemms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(
    calls: Sequence[Callable[[], Any]],
    device: torch.device,
    *,
    repeats: int = 3,
    min_seconds: float = 0.005,
) -> float:
    """Seconds of one pass over `calls`: after a warm-up pass, the best of `repeats` timings,
    each of as many passes as fill `min_seconds` (the device synchronized around each)."""
    clock = time.perf_counter

    def passes(n: int) -> float:
        _sync(device)
        start = clock()
        for _ in range(n):
            for call in calls:
                call()
        _sync(device)
        return (clock() - start) / n

    with torch.inference_mode():  # gradients off: `linear` takes the route serving takes
        first = passes(1)
        n = max(1, math.ceil(min_seconds / max(first, 1e-9)))
        return min(passes(n) for _ in range(max(1, repeats)))


def gemm_roofline(
    model: torch.nn.Module,
    rows: int,
    sampled_rows: int | None = None,
    *,
    repeats: int = 3,
    min_seconds: float = 0.005,
) -> dict[str, Any]:
    """GFLOP/s of the matmuls of one step of `rows` new tokens (`sampled_rows` through the
    lm_head; default all) run alone (`step_gemms`, timed by `best_seconds`): `flops` per
    pass, `seconds` per pass, `gflops`, `gemms` (products per pass) and `shapes` (the
    distinct (rows, in, out) shapes timed)."""
    gemms = step_gemms(model, rows, sampled_rows)
    device = next(model.parameters()).device
    seconds = best_seconds([g.run for g in gemms], device, repeats=repeats, min_seconds=min_seconds)
    flops = sum(g.flops for g in gemms)
    return {
        "rows": rows,
        "sampled_rows": rows if sampled_rows is None else sampled_rows,
        "flops": flops,
        "seconds": seconds,
        "gflops": flops / seconds / 1e9,
        "gemms": len(gemms),
        "shapes": sorted({g.shape for g in gemms}),
    }


def peak_gflops(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    size: int = PEAK_GEMM_SIZE,
    *,
    repeats: int = 3,
) -> float:
    """GFLOP/s of one `size`^3 GEMM through `astrai.extension.linear` (best of `repeats`):
    what the matmul route reaches on a large, compute-bound product, for context."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(size, size, generator=gen).to(device, dtype) for _ in range(2))
    seconds = best_seconds([partial(linear, x, w)], device, repeats=repeats)
    return 2 * size**3 / seconds / 1e9
