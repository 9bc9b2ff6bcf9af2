"""Building blocks shared by training and inference: RMSNorm, RoPE, attention projections, MLP.

Training and serving run these same modules, which is why log-probs agree between them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from astrai.extension import KVCache, attention, linear
from astrai.extension.linear import last_level_cache_bytes, prepack_weight
from astrai.extension.lora import LoRALayer
from astrai.extension.quantized import int8_linear, quantize_int8
from astrai.model.config import ModelConfig
from astrai.model.documents import DocumentSpans, training_attention
from astrai.model.gemma_config import attention_scale
from astrai.model.rope import rotary_for

#: on while an engine runs the model (`engine_forward`): only then do the projections use the
#: engine's packs and its cache-residency choice, so building an engine on a model leaves that
#: model's own forward (a training step's no-grad scoring, a reference, an export's check)
#: computing exactly what it computed before
_ENGINE_FORWARD: ContextVar[bool] = ContextVar("astrai_engine_forward", default=False)


@contextmanager
def engine_forward() -> Iterator[None]:
    """The engine's forwards (its runner, graph capture, draft model) run inside this."""
    token = _ENGINE_FORWARD.set(True)
    try:
        yield
    finally:
        _ENGINE_FORWARD.reset(token)


def in_engine_forward() -> bool:
    """Whether an engine's forward is running (`engine_forward`)."""
    return _ENGINE_FORWARD.get()


class Linear(nn.Linear):
    """`nn.Linear` whose matmul is `astrai.extension.linear` (oneDNN for fp32 CPU inference).

    Same parameters and state-dict keys as `nn.Linear`, so checkpoints, LoRA and HF
    import/export see no difference. `cache_resident` (set by `mark_cache_resident`): the
    model's weights fit in the CPU's cache, where tiny products are faster on `F.linear`.
    `pack`: its weight prepacked for inference (`astrai.model.packed`); never used with
    gradients on. `lora`: an engine's adapter stacks for this projection, whose per-token
    deltas it adds while the engine runs a step with adapter rows (`astrai.extension.lora`).
    """

    cache_resident: bool = False
    pack: PackedLinear | None = None
    lora: LoRALayer | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        engine = _ENGINE_FORWARD.get()
        pack = self.pack
        if engine and pack is not None and not torch.is_grad_enabled() and pack.serves(self):
            return pack(x)[0]
        out = linear(x, self.weight, self.bias, small_on_aten=engine and self.cache_resident)
        if self.lora is not None:
            self.lora.apply(x, out)
        return out

    def product_terms(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(x, weight)]``: this layer's output is ``x @ weight.T`` (the chunked LM head,
        `astrai.model.head`, computes it block by block); a biased layer has no such form."""
        if self.bias is not None:
            raise ValueError("the chunked LM head needs a head without bias")
        return [(x, self.weight)]


class PackedLinear:
    """The weights (and biases) of one or more `Linear`s that read the same input, for
    inference: several are concatenated on the output axis (one product instead of
    several), and with `prepack_rows` the result is also kept in oneDNN's blocked layout
    for products of about that many rows (`astrai.extension.linear.prepack_weight`).
    `astrai.model.packed` says when engines make them, what they cost and how they stay in
    step with the parameters. `quantization` ("int8_weight_only"): the packed weight is kept
    as int8 with per-channel scales instead (`astrai.extension.quantized`), no fp32 copy."""

    def __init__(
        self,
        sources: Sequence[Linear],
        prepack_rows: int | None = None,
        quantization: str | None = None,
    ) -> None:
        if not sources or any(type(m) is not Linear for m in sources):
            raise TypeError("PackedLinear packs plain astrai Linear layers only")
        if len({m.in_features for m in sources}) != 1:
            raise ValueError("PackedLinear: the packed layers must read the same input size")
        self.sources = tuple(sources)
        self.sizes = [m.out_features for m in sources]
        self.prepack_rows = prepack_rows  # unused when quantized
        self.quantization = quantization
        self.qweight: torch.Tensor | None = None  # int8 [out, in] (quantization)
        self.scales: torch.Tensor | None = None  # fp32 [out]
        self.weight: torch.Tensor | None = torch.empty(0)
        self.bias: torch.Tensor | None = None
        self.prepacked: torch.Tensor | None = None
        self._key: tuple = ()
        self.refresh()

    def _key_now(self) -> tuple:
        # The tensor version counter (bumped by every in-place write) has no public getter.
        return tuple(
            (id(p), p.data_ptr(), p._version)
            for m in self.sources
            for p in (m.weight, m.bias)
            if p is not None
        )

    def refresh(self) -> None:
        """Copy the sources' current values in, if any changed since the last copy; in place
        when device, dtype and shapes are unchanged (captured graphs keep the address)."""
        key = self._key_now()
        if key == self._key:
            return
        sources = self.sources
        with torch.inference_mode():
            if len(sources) == 1:  # nothing to concatenate: the parameters themselves
                weight, self.bias = sources[0].weight, sources[0].bias
            else:
                weight = _cat_into(self.weight, [m.weight for m in sources])
                self.bias = None
                if any(m.bias is not None for m in sources):
                    parts = [
                        m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                        for m in sources
                    ]
                    self.bias = _cat_into(self.bias, parts)
            self.prepacked = None
            if self.quantization is not None:
                self._quantize(weight)
                self.weight = None
                self._key = key
                return
            if self.prepack_rows is not None:
                self.prepacked = prepack_weight(weight, self.prepack_rows)
            # A prepacked copy serves every product unless tiny ones go to F.linear.
            keep = self.prepacked is None or sources[0].cache_resident or len(sources) == 1
            self.weight = weight if keep else None
        self._key = key

    def _quantize(self, weight: torch.Tensor) -> None:
        """int8 weight and scales from `weight`, in place when the shapes are unchanged
        (captured graphs keep the address)."""
        qweight, scales = quantize_int8(weight)
        if self.qweight is not None and self.qweight.shape == qweight.shape:
            self.qweight.copy_(qweight)
            self.scales.copy_(scales)
        else:
            self.qweight, self.scales = qweight, scales

    def serves(self, *modules: nn.Module) -> bool:
        """Whether this pack stands for exactly `modules` (refreshed if a weight changed);
        False once one of them was replaced (e.g. wrapped by LoRA)."""
        sources = self.sources
        if len(modules) != len(sources) or any(a is not b for a, b in zip(modules, sources)):
            return False
        self.refresh()
        return True

    @property
    def nbytes(self) -> int:
        """Bytes this pack holds beyond the parameters (a prepacked layout's padding aside)."""
        total = 0
        if self.qweight is not None:
            total += self.qweight.numel() + self.scales.numel() * 4
        if self.prepacked is not None:
            total += math.prod(self.prepacked.shape) * 4  # fp32 only
        if len(self.sources) > 1:
            if self.weight is not None:
                total += self.weight.numel() * self.weight.element_size()
            if self.bias is not None:
                total += self.bias.numel() * self.bias.element_size()
        return total

    def __reduce__(self) -> tuple:
        # Engine state, not model state: a deep copy or a pickle of the model (an export,
        # a frozen reference) has no pack; oneDNN's opaque layouts could not be copied anyway.
        return (_no_pack, ())

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each source's output, as views of one product's columns (with the source's
        adapter deltas, in an engine step with adapter rows)."""
        if self.qweight is not None:
            out = int8_linear(x, self.qweight, self.scales, self.bias)
        else:
            out = linear(
                x,
                self.weight,
                self.bias,
                small_on_aten=self.sources[0].cache_resident,
                prepacked=self.prepacked,
            )
        parts = out.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (out,)
        for source, part in zip(self.sources, parts):
            if source.lora is not None:
                source.lora.apply(x, part)
        return parts


def _no_pack() -> None:
    return None


def _cat_into(dst: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor:
    rows = sum(p.shape[0] for p in parts)
    first = parts[0]
    shape = (rows, *first.shape[1:])
    if dst is None or dst.shape != shape or dst.dtype != first.dtype or dst.device != first.device:
        return torch.cat(parts)
    return torch.cat(parts, out=dst)


def mark_cache_resident(model: nn.Module) -> bool:
    """Flag `model`'s `Linear` layers as cache-resident when all its parameters fit in half
    the CPU's last-level cache (the rest is left to the KV cache and activations); returns
    the verdict. Only fp32 CPU inference reads the flag (`astrai.extension.linear`)."""
    params = list(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    on_cpu = all(p.device.type == "cpu" for p in params)
    resident = on_cpu and nbytes <= last_level_cache_bytes() // 2
    for module in model.modules():
        if isinstance(module, Linear):
            module.cache_resident = resident
    return resident


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as Llama/Qwen do) and cast back."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            if x.device.type == "cpu":
                # torch's CPU rms_norm is a composite of six ops; these four compute the
                # same values (bit-identical) in place: 12.5 instead of 19 us for 48 x 512
                # rows, 32 instead of 58 for a 300-row prefill (experiments/bench/engine.md)
                ms = torch.mean(x * x, -1, keepdim=True).add_(self.eps)
                return torch.mul(x, ms.rsqrt_()).mul_(self.weight)
            # fp32 inference: the weight inside the fused op (bit-identical, one op less per
            # norm: decoding small models is bound by such per-op costs)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # torch's fused kernel: the same x * rsqrt(mean(x^2) + eps) in fp32, in one op.
        h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over all heads of a q or k projection at once (OLMo 2), given `[..., heads,
    head_dim]`: the statistics span the whole projection, as before OLMo 2's head split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # out of place, in fp32: under tensor parallelism `x` is a DTensor of the local heads
        # and the mean over the whole projection an all-reduce (astrai.train.tensor_parallel)
        h = x.flatten(-2).float()
        h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(x.dtype)).view(x.shape)


def qk_norms(config: ModelConfig, norm: type[RMSNorm] = RMSNorm) -> tuple[RMSNorm, RMSNorm]:
    """q and k norms of `config.qk_norm_scope`: per head (Qwen3; `norm`, which Gemma's
    (1 + w) norm replaces) or per projection (OLMo 2)."""
    d, eps = config.head_dim, config.rms_norm_eps
    if config.qk_norm_scope == "projection":
        return (
            ProjectionRMSNorm(config.num_attention_heads * d, eps),
            ProjectionRMSNorm(config.num_key_value_heads * d, eps),
        )
    return norm(d, eps), norm(d, eps)


# ---------------------------------------------------------------------- attention and MLP
class Attention(nn.Module):
    """Grouped-query self-attention with optional q/k norm (Qwen3) and biases (Qwen2).

    `packed_qkv`: q/k/v packed into one weight for inference (`astrai.model.packed`), set
    when an engine starts; training never uses it.
    """

    packed_qkv: PackedLinear | None = None

    def __init__(self, config: ModelConfig, layer_id: int, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = attention_scale(config)  # Gemma: query_pre_attn_scalar ** -0.5
        self.window = config.layer_window(layer_id)  # None: attends to the whole prefix
        h, q, kv = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = Linear(h, q, bias=config.attention_bias)
        self.k_proj = Linear(h, kv, bias=config.attention_bias)
        self.v_proj = Linear(h, kv, bias=config.attention_bias)
        self.o_proj = Linear(q, h, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm, self.k_norm = qk_norms(config, norm)
        else:
            self.q_norm = self.k_norm = None
        self.rotate_qk = rotary_for(config)
        # GPT-OSS: a learned logit per head in each softmax's denominator (training and engine)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as `[..., heads, head_dim]`, with q/k norm and RoPE already applied."""
        lead = x.shape[:-1]
        packed = self.packed_qkv
        if (
            packed is not None
            and not torch.is_grad_enabled()
            and _ENGINE_FORWARD.get()
            and packed.serves(self.q_proj, self.k_proj, self.v_proj)
        ):  # inference: one product for the three (astrai.model.packed)
            q, k, v = packed(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # -1: the heads this process computes (all, or its share under tensor parallelism,
        # whose column-parallel projections return the local heads only)
        q = q.view(*lead, -1, self.head_dim)
        k = k.view(*lead, -1, self.head_dim)
        v = v.view(*lead, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate_qk(q, k, cos, sin)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | DocumentSpans | None = None,
    ) -> torch.Tensor:
        """Dense `[B, S, H]` path; `attn_mask` is a boolean `[B, 1, S, S]`, the spans of packed
        documents, or None for causal (`astrai.model.documents`)."""
        b, s, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        out = training_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
            window=self.window,
            sinks=self.sinks,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        """Packed `[T, H]` inference path: K/V go to the cache, attention reads it back."""
        q, k, v = self.project(x, cos, sin)
        out = attention(
            q, k, v, kv_cache, self.layer_id, scale=self.scale, window=self.window, sinks=self.sinks
        )
        return self.o_proj(out.reshape(x.shape[0], -1))


#: the gate activation of `MLP` for each `ModelConfig.hidden_act` (astrai/model/gemma_config.py)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); act is silu (SwiGLU) or Gemma's tanh GELU.

    `packed_gate_up`: gate/up packed into one weight for inference (`astrai.model.packed`).
    """

    packed_gate_up: PackedLinear | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_gate_up
        if (
            packed is not None
            and not torch.is_grad_enabled()
            and _ENGINE_FORWARD.get()
            and packed.serves(self.gate_proj, self.up_proj)
        ):
            gate, up = packed(x)
            return self.down_proj(self.act(gate).mul_(up))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
