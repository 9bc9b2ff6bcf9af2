"""Model hyper-parameters, their JSON form (`config.json`) and named presets."""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astrai.model.gemma_config import gemma_problems
from astrai.model.gpt_oss_config import gpt_oss_param_delta, gpt_oss_problems
from astrai.model.mla_config import mla_attention_params, mla_head_dim, mla_problems
from astrai.model.moe_config import as_list, moe_layer, moe_param_delta, moe_problems
from astrai.model.variant_config import variant_problems
from astrai.model.window_config import layer_window, window_problems

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Fields each RoPE scaling type needs, beyond `rope_type`.
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}


class ConfigError(ValueError):
    """A model configuration that cannot describe a valid model; the message names the field."""


@dataclass
class ModelConfig:
    """Architecture of a Llama/Qwen-family decoder.

    Field names follow Hugging Face's so that their `config.json` files translate with few
    renames. `attention_bias` puts a bias on the q/k/v projections (the Qwen2 convention);
    `o_proj_bias` on the output projection (Llama's `attention_bias=True` sets both).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # The HF architecture a checkpoint came from (llama, qwen2, qwen3, mistral); HF export
    # writes it back when it can represent the model, so a Mistral stays a Mistral.
    hf_model_type: str | None = None
    # ---- mixture of experts (astrai/model/moe.py); num_experts=0 is a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    norm_topk_prob: bool = False
    router_scoring: str = "softmax"
    router_topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_correction_bias: bool = False
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    decoder_sparse_step: int = 1
    first_k_dense_replace: int = 0
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    # ---- multi-head latent attention (astrai/model/mla.py); head_dim is then the rotary dim
    attention_type: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # ---- block variants (astrai/model/variants.py): OLMo 2 and Phi-3 / Phi-4
    # "pre": x + f(norm(x)) (Llama); "post": x + norm(f(x)) (OLMo 2, no input norm);
    # "sandwich": x + norm(f(norm(x))) (Gemma 3, astrai/model/sandwich.py)
    norm_position: str = "pre"
    # "head": q/k RMSNorm per head (Qwen3); "projection": over the whole projection (OLMo 2)
    qk_norm_scope: str = "head"
    # RoPE rotates the first `int(head_dim * partial_rotary_factor)` dims of each head (Phi-4-mini)
    partial_rotary_factor: float = 1.0
    # ---- sliding-window attention (astrai/model/window_config.py; HF's names and meaning)
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # ---- GPT-OSS (astrai/model/gpt_oss_config.py; HF's names and meaning)
    # a learned per-head logit that joins each attention softmax's denominator (`sinks`)
    attention_sinks: bool = False
    # a bias on the router's logits (`mlp.router.bias`)
    router_bias: bool = False
    # biases on the routed experts' gate/up and down projections
    expert_bias: bool = False
    # the experts' clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * gate *
    # sigmoid(swiglu_alpha * gate); None is the plain silu(gate) * up
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # ---- Gemma 3 (astrai/model/gemma_config.py; HF's names where HF has one)
    # the gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    hidden_act: str = "silu"
    # "rms": x * w (Llama); "gemma": x * (1 + w) in fp32, weights initialised to zeros
    norm_type: str = "rms"
    # embeddings multiplied by sqrt(hidden_size), rounded to the embedding dtype (Gemma)
    scale_embeddings: bool = False
    # attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    query_pre_attn_scalar: float | None = None
    # RoPE base of the sliding-window layers, without scaling (None: the same RoPE as all)
    rope_local_base_freq: float | None = None

    def __post_init__(self) -> None:
        self.mlp_only_layers = as_list(self.mlp_only_layers)  # a tuple or Hydra's ListConfig
        if self.layer_types is not None:
            self.layer_types = as_list(self.layer_types)
        self._check_types()
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.head_dim = mla_head_dim(self)  # MLA: the rotary dim (astrai/model/mla_config.py)
        if self.head_dim is None and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.rope_scaling is not None:
            self.rope_scaling = {k: as_list(v) for k, v in self.rope_scaling.items()}
            kind = self.rope_scaling.pop("type", None)
            self.rope_scaling.setdefault("rope_type", kind or "default")
        self.validate()

    # ------------------------------------------------------------------ validation
    def _check_types(self) -> None:
        hints = typing.get_type_hints(ModelConfig)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _type_ok(value, hints[f.name]):
                raise ConfigError(
                    f"ModelConfig.{f.name}: expected {_type_name(hints[f.name])}, "
                    f"got {type(value).__name__} ({value!r})"
                )

    def validate(self) -> None:
        """Check types and cross-field constraints; raise `ConfigError` naming the field."""
        self._check_types()
        for problem in mla_problems(self):  # MLA fields: astrai/model/mla_config.py
            raise ConfigError(problem)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"ModelConfig.{name}: must be positive, got {getattr(self, name)}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "ModelConfig.num_key_value_heads: must divide num_attention_heads "
                f"({self.num_attention_heads} % {self.num_key_value_heads} != 0)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"ModelConfig.head_dim: must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ConfigError(
                f"ModelConfig.rms_norm_eps: must be positive, got {self.rms_norm_eps}"
            )
        if self.rope_theta <= 0:
            raise ConfigError(f"ModelConfig.rope_theta: must be positive, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in ROPE_TYPES:
                raise ConfigError(
                    f"ModelConfig.rope_scaling.rope_type: {kind!r} is not one of {list(ROPE_TYPES)}"
                )
            for key in _ROPE_REQUIRED[kind]:
                if key not in self.rope_scaling:
                    raise ConfigError(f"ModelConfig.rope_scaling.{key}: required for {kind!r}")
            factor = self.rope_scaling.get("factor")
            if factor is not None and (not isinstance(factor, int | float) or factor <= 0):
                raise ConfigError(f"ModelConfig.rope_scaling.factor: must be > 0, got {factor!r}")
            if kind == "longrope":
                self._check_longrope()
        for problem in moe_problems(self):  # MoE fields: astrai/model/moe_config.py
            raise ConfigError(problem)
        for problem in variant_problems(self):  # block variants: astrai/model/variant_config.py
            raise ConfigError(problem)
        for problem in window_problems(self):  # astrai/model/window_config.py
            raise ConfigError(problem)
        for problem in gpt_oss_problems(self):  # astrai/model/gpt_oss_config.py
            raise ConfigError(problem)
        for problem in gemma_problems(self):  # astrai/model/gemma_config.py
            raise ConfigError(problem)

    def _check_longrope(self) -> None:
        half = self.rotary_dim() // 2
        for key in ("short_factor", "long_factor"):
            values = self.rope_scaling[key]
            if not isinstance(values, list) or len(values) != half:
                raise ConfigError(
                    f"ModelConfig.rope_scaling.{key}: expected {half} numbers (one per rotary "
                    f"frequency), got {values!r}"
                )
        original = self.rope_scaling["original_max_position_embeddings"]
        if not isinstance(original, int) or original <= 0:
            raise ConfigError(
                "ModelConfig.rope_scaling.original_max_position_embeddings: must be a positive "
                f"int, got {original!r}"
            )

    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (all but under `partial_rotary_factor`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has a routed-expert MLP (Qwen's and DeepSeek's rules)."""
        return moe_layer(self, layer_id)

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of block `layer_id`, or None where it attends fully."""
        return layer_window(self, layer_id)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> ModelConfig:
        """Build from a plain dict; unknown or missing fields are errors that name them."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - {"model_type", "architectures", "astrai_version"})
        if unknown:
            raise ConfigError(
                f"{source}: unknown field(s) {unknown}; known fields: {sorted(names)}"
            )
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in data]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {missing}")
        kwargs = {k: v for k, v in data.items() if k in names}
        try:
            return cls(**kwargs)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None

    def to_json(self) -> str:
        return json.dumps({"model_type": "astrai", **self.to_dict()}, indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str, *, source: str = "config.json") -> ModelConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source}: not valid JSON ({err})") from None
        return cls.from_dict(data, source=source)

    def save(self, path: str | os.PathLike) -> None:
        """Write `config.json` atomically so a crash never leaves a half-written file."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        return cls.from_json(path.read_text(), source=str(path))

    # ------------------------------------------------------------------ derived sizes
    def num_parameters(self) -> int:
        """Parameter count computed from the shapes alone (no tensors are created)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.o_proj_bias:
            attn += h
        if self.qk_norm:
            attn += q + kv if self.qk_norm_scope == "projection" else 2 * d
        if self.attention_type == "mla":  # astrai/model/mla_config.py
            attn = mla_attention_params(self)
        norms = 4 if self.norm_position == "sandwich" else 2  # Gemma's sandwich: four
        block = attn + 3 * h * self.intermediate_size + norms * h
        embed = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        moe = moe_param_delta(self)  # sparse layers: router + experts instead of the dense MLP
        extra = gpt_oss_param_delta(self)  # sinks, router and expert biases
        return embed + self.num_hidden_layers * block + h + head + moe + extra


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is bool:
        return isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (arg,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, arg) for v in value)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


# ---------------------------------------------------------------------- presets
#: the keyword options of `astrai.model.preset_model` that are not config fields (what a
#: `conf/model/` preset may set besides them), for checks that must not import torch
FACTORY_OPTIONS = ("device", "tokenizer", "compile")

PRESETS: dict[str, dict[str, Any]] = {
    # For unit tests: a forward pass takes milliseconds on a CPU.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    # Multi-head latent attention (DeepSeek-V2/V3 style) at unit-test size.
    "tiny-mla": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        attention_type="mla",
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    # A few million parameters: the default CPU experiment finishes in minutes.
    "astrai-5m": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # About 30M parameters: the CPU engine benchmark model.
    "astrai-30m": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # astrai-30m with MLA (DeepSeek-V2-Lite-like: no q compression): the KV-size comparison of
    # `bench engine` (160 cached values per token and layer against astrai-30m's 512).
    "astrai-30m-mla": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        attention_type="mla",
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "astrai-1b": dict(
        vocab_size=100000,
        hidden_size=1536,
        intermediate_size=6912,
        num_hidden_layers=24,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=32768,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # Mixture of experts for unit tests: 4 experts (2 per token), a gated shared expert and a
    # dense first layer (Qwen2-MoE's shape), so every MoE code path runs in milliseconds.
    "tiny-moe": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        num_shared_experts=1,
        shared_expert_gate=True,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    # astrai-5m with 8 experts of half its intermediate size, 2 per token: the same active MLP
    # parameters per token as the dense model, 4x in total (experiment tiny_pretrain_moe).
    "astrai-5m-moe": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=352,
        router_aux_loss_coef=0.01,
    ),
    # OLMoE-1B-7B's shape class: 64 experts of 1024, 8 per token; ~1.3B active, ~6.9B total.
    "astrai-1b-moe": dict(
        vocab_size=100000,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        qk_norm=True,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=1024,
        router_aux_loss_coef=0.01,
    ),
    # Qwen3-0.6B's shape (random weights in benchmarks; real weights load from an HF directory).
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qk_norm=True,
    ),
    # Qwen3-8B's shape (its published config.json; transformers' Qwen3Config defaults are a
    # generic 32-layer model, not this one): ~8.19B parameters, untied head. experiment=grpo_8b
    # plans and meta-builds with it; real weights load from an HF directory (model.path).
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        qk_norm=True,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named configuration, optionally with some fields replaced."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides}, source=f"preset {name!r}")


__all__ = ["PRESETS", "ROPE_TYPES", "ConfigError", "ModelConfig", "preset"]
