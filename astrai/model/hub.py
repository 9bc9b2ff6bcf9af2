"""Model directories: `config.json` + safetensors weights (+ tokenizer files).

Weights are always stored under Hugging Face's names (`model.layers.0.self_attn...`; MoE
experts one tensor per expert, as HF writes them, stacked in memory by `hf_moe`), so our
directories differ from HF's only in `config.json`. `from_pretrained` reads ours and HF
Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE (`hf_moe`), DeepSeek-V2/V3
(`hf_deepseek`), OLMo 2 (`hf_olmo2`), Phi-3 / Phi-4 (`hf_phi3`), GPT-OSS (`hf_gpt_oss`) and
Gemma 3 text (`hf_gemma3`) directories;
`save_pretrained(hf_format=True)` writes one that `transformers.AutoModelForCausalLM` loads. Nothing here uses pickle.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from astrai.files import naming_full_disk, publish
from astrai.model import (
    hf_deepseek,
    hf_fp8,
    hf_gemma3,
    hf_gpt_oss,
    hf_moe,
    hf_mxfp4,
    hf_olmo2,
    hf_phi3,
)
from astrai.model.config import ConfigError, ModelConfig
from astrai.model.directory import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME
from astrai.model.hf_common import hf_base_fields
from astrai.model.transformer import Transformer

if TYPE_CHECKING:
    from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = 2 * 1024**3

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}
HF_ARCHITECTURES.update(hf_moe.MOE_ARCHITECTURES)  # Mixtral, Qwen2-MoE, Qwen3-MoE
HF_ARCHITECTURES.update(hf_deepseek.DEEPSEEK_ARCHITECTURES)  # DeepSeek-V2 / V3 (MLA)
HF_ARCHITECTURES.update(hf_olmo2.OLMO2_ARCHITECTURES)  # OLMo 2 (post-norm)
HF_ARCHITECTURES.update(hf_phi3.PHI3_ARCHITECTURES)  # Phi-3 / Phi-4 (fused projections)
HF_ARCHITECTURES.update(hf_gpt_oss.GPT_OSS_ARCHITECTURES)  # GPT-OSS (sinks, biased experts)
HF_ARCHITECTURES.update(hf_gemma3.GEMMA3_ARCHITECTURES)  # Gemma 3 text (sandwich blocks)
# Old HF checkpoints sometimes carry these non-parameter buffers.
_IGNORED_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint directory or file that does not match the model; names the file/tensor."""


# ---------------------------------------------------------------------- key names
def to_hf_key(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def from_hf_key(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


# ---------------------------------------------------------------------- config translation
def config_from_hf(data: dict[str, Any], *, source: str = CONFIG_NAME) -> ModelConfig:
    """Translate an HF Llama / Qwen2 / Qwen3 / Mistral `config.json` dict."""
    data = hf_gemma3.llama_view(data, source)  # Gemma 3: per-type RoPE, HF's defaults
    model_type = data.get("model_type")
    if model_type not in HF_ARCHITECTURES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported; "
            f"expected 'astrai' or one of {sorted(HF_ARCHITECTURES)}"
        )
    if model_type in hf_deepseek.DEEPSEEK_ARCHITECTURES:  # MLA + DeepSeek MoE: hf_deepseek.py
        return hf_deepseek.config_from_hf(data, source=source)
    if data.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    act = data.get("hidden_act") or "silu"
    if act != "silu" and model_type not in hf_gemma3.GEMMA3_ARCHITECTURES:  # Gemma: its own
        raise ConfigError(
            f"{source}: hidden_act={act!r} is not supported for {model_type} (its MLP is "
            "SwiGLU here: silu only)"
        )
    rope_params = dict(data.get("rope_parameters") or {})
    if rope_params and all(isinstance(v, dict) for v in rope_params.values()):
        raise ConfigError(f"{source}: per-layer rope_parameters are not supported")
    partial = rope_params.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0) and model_type not in hf_phi3.PHI3_ARCHITECTURES:
        raise ConfigError(f"{source}: partial_rotary_factor={partial} is not supported")
    theta = rope_params.pop("rope_theta", None) or data.get("rope_theta") or 10000.0
    rope_params.pop("partial_rotary_factor", None)
    scaling = data.get("rope_scaling") or rope_params or None
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.pop("type", None) or scaling.get("rope_type") or "default"
        scaling["rope_type"] = kind
        if kind == "default":
            scaling = None
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    elif model_type == "mistral":
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = bool(data.get("attention_bias", False))
    fields = dict(
        vocab_size=data.get("vocab_size"),
        hidden_size=data.get("hidden_size"),
        intermediate_size=data.get("intermediate_size"),
        num_hidden_layers=data.get("num_hidden_layers"),
        num_attention_heads=data.get("num_attention_heads"),
        num_key_value_heads=data.get("num_key_value_heads"),
        head_dim=data.get("head_dim"),
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=data.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        qk_norm=model_type == "qwen3",
        initializer_range=data.get("initializer_range", 0.02),
        bos_token_id=data.get("bos_token_id"),
        eos_token_id=data.get("eos_token_id"),
        pad_token_id=data.get("pad_token_id"),
        hf_model_type=model_type,
    )
    fields.update(hf_moe.config_fields(data, model_type, source))
    fields.update(hf_olmo2.config_fields(data, model_type, source))
    fields.update(hf_phi3.config_fields(data, model_type, source))
    fields.update(hf_gpt_oss.config_fields(data, model_type, source))
    fields.update(hf_gemma3.config_fields(data, model_type, source))
    fields.update(_window_from_hf(data, model_type, source))
    missing = [k for k, v in fields.items() if v is None and k in _HF_REQUIRED]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {missing}")
    return ModelConfig.from_dict({k: v for k, v in fields.items() if v is not None}, source=source)


# Where a checkpoint's `sliding_window` applies, as each transformers model reads it: on every
# layer (Mistral, Mixtral; Qwen3-MoE once `use_sliding_window`), or on the layers its
# `layer_types` names (Qwen2/Qwen3, Qwen2-MoE; derived from `max_window_layers` when absent).
_EVERY_LAYER_WINDOW = ("mistral", "mixtral", "qwen3_moe")


def _window_from_hf(data: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """`sliding_window` / `layer_types` as transformers reads them: Mistral's and Mixtral's
    window covers every layer; the Qwen families need `use_sliding_window`, and then Qwen3-MoE
    windows every layer, while Qwen2/Qwen3 window the layers from `max_window_layers` on and
    Qwen2-MoE the even layers below it, unless `layer_types` lists them."""
    window = data.get("sliding_window")
    if not window or not (model_type in ("mistral", "mixtral") or data.get("use_sliding_window")):
        return {}
    if model_type in _EVERY_LAYER_WINDOW:
        return {"sliding_window": window}
    types = data.get("layer_types")
    if types is None:
        types = _qwen_layer_types(model_type, data["num_hidden_layers"], data)
    if "sliding_attention" not in types:
        return {}
    return {"sliding_window": window, "layer_types": list(types)}


def _qwen_layer_types(model_type: str, layers: int, data: dict[str, Any]) -> list[str]:
    """transformers' default `layer_types` of a Qwen config with `use_sliding_window`."""
    start = data.get("max_window_layers", 28)
    if model_type == "qwen2_moe":  # Qwen2MoeConfig: even layers below max_window_layers
        local = [i % 2 == 0 and i < start for i in range(layers)]
    else:
        local = [i >= start for i in range(layers)]
    return ["sliding_attention" if x else "full_attention" for x in local]


_HF_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


def hf_model_type(config: ModelConfig) -> str:
    """The HF architecture that represents `config` exactly, or a ConfigError saying why none does.

    The architecture the checkpoint came from wins when it fits (Mistral and Llama compute
    the same function, but users expect to get back what they loaded).
    """
    if config.attention_type == "mla":
        return hf_deepseek.hf_deepseek_model_type(config)
    if hf_gpt_oss.is_gpt_oss(config):
        return hf_gpt_oss.hf_gpt_oss_model_type(config)
    if hf_gemma3.is_gemma3(config):
        return hf_gemma3.hf_gemma3_model_type(config)
    if hf_olmo2.is_olmo2(config):
        return hf_olmo2.hf_olmo2_model_type(config)
    phi3 = hf_phi3.hf_phi3_model_type(config)
    if phi3 is not None:
        return phi3
    if config.num_experts:
        return _moe_window_checked(hf_moe.hf_moe_model_type(config), config)
    plain = not (config.qk_norm or config.attention_bias or config.o_proj_bias)
    if config.sliding_window is not None:
        return _windowed_model_type(config, plain)
    if config.hf_model_type == "mistral" and plain:
        return "mistral"
    if config.qk_norm:
        if config.attention_bias != config.o_proj_bias:
            raise ConfigError("qk_norm with attention_bias != o_proj_bias has no HF equivalent")
        return "qwen3"
    if config.attention_bias and not config.o_proj_bias:
        return "qwen2"
    if config.attention_bias != config.o_proj_bias:
        raise ConfigError("o_proj_bias without attention_bias has no HF equivalent")
    return "llama"


def _moe_window_checked(model_type: str, config: ModelConfig) -> str:
    """`model_type` when its config can hold `config`'s window: Qwen2-MoE any `layer_types`,
    Mixtral and Qwen3-MoE only one window on every layer."""
    every = config.layer_types is None or set(config.layer_types) == {"sliding_attention"}
    if config.sliding_window is None or every or model_type == "qwen2_moe":
        return model_type
    raise ConfigError(
        f"ModelConfig.layer_types: {model_type} holds one window on every layer; this model "
        "windows only some (Qwen2-MoE, with shared experts, holds per-layer windows)"
    )


def _windowed_model_type(config: ModelConfig, plain: bool) -> str:
    """Mistral holds one window on every layer; Qwen2/3 hold per-layer `layer_types`."""
    every = config.layer_types is None or set(config.layer_types) == {"sliding_attention"}
    if plain and every and config.hf_model_type in (None, "mistral", "llama"):
        return "mistral"
    if config.qk_norm and config.attention_bias == config.o_proj_bias:
        return "qwen3"
    if config.attention_bias and not config.o_proj_bias:
        return "qwen2"
    if plain and every:
        return "mistral"
    raise ConfigError(
        "ModelConfig.sliding_window: no HF architecture holds this model "
        "(Mistral: one window on every layer without biases; Qwen2/3: biases as theirs)"
    )


def config_to_hf(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    if config.attention_type == "mla":
        return hf_deepseek.config_to_hf(config, dtype)
    model_type = hf_model_type(config)
    data = hf_base_fields(config, HF_ARCHITECTURES[model_type], model_type, dtype)
    data.update(num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim)
    if model_type in ("llama", "qwen3"):
        data["attention_bias"] = config.attention_bias
    if model_type == "llama":
        data["mlp_bias"] = False
    if model_type in ("qwen2", "qwen3"):
        data["use_sliding_window"] = False
        data["sliding_window"] = None
    data.update(hf_moe.config_to_hf_fields(config, model_type))
    data.update(_window_to_hf(config, model_type))  # after the MoE fields, which clear it
    data.update(hf_olmo2.config_to_hf_fields(config, model_type))
    data.update(hf_phi3.config_to_hf_fields(config, model_type))
    data.update(hf_gpt_oss.config_to_hf_fields(config, model_type))
    data.update(hf_gemma3.config_to_hf_fields(config, model_type))
    return data


def _window_to_hf(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The window fields transformers reads back as `config` (see `_window_from_hf`)."""
    if model_type in ("mistral", "mixtral"):
        return {"sliding_window": config.sliding_window}
    if config.sliding_window is None or model_type not in ("qwen2", "qwen3", *_QWEN_MOE):
        return {}
    if model_type == "qwen3_moe":
        return {"use_sliding_window": True, "sliding_window": config.sliding_window}
    types = config.layer_types or ["sliding_attention"] * config.num_hidden_layers
    first = types.index("sliding_attention")
    return {
        "use_sliding_window": True,
        "sliding_window": config.sliding_window,
        "max_window_layers": first if model_type != "qwen2_moe" else config.num_hidden_layers,
        "layer_types": list(types),
    }


_QWEN_MOE = ("qwen2_moe", "qwen3_moe")


def read_config(path: str | os.PathLike) -> ModelConfig:
    """Read `config.json` of an astrai or HF directory."""
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in model directory {path}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object")
    if data.get("model_type", "astrai") == "astrai":
        return ModelConfig.from_dict(data, source=str(file))
    return config_from_hf(data, source=str(file))


# ---------------------------------------------------------------------- weights
def weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a directory, single or sharded."""
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err!r})") from None
        files = sorted({path / name for name in weight_map.values()})
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index}: shard file(s) missing: {absent}")
        return files
    single = path / WEIGHTS_NAME
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(
            f"{path}: only pickle-based weights (*.bin / *.pt) found; astrai never unpickles "
            "checkpoints. Convert them to safetensors first."
        )
    raise FileNotFoundError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path}")


def read_state_dict(
    path: str | os.PathLike, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a directory under their stored (HF) names."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise CheckpointError(
                f"{file}: corrupt or truncated safetensors file ({err})"
            ) from None
    return tensors


def _list(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def read_hf_state(
    path: str | os.PathLike,
    config: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """A directory's tensors under HF names in our layout: stale rotary buffers dropped,
    block-fp8 and MXFP4 weights dequantised (to `dtype`), per-expert tensors stacked, DeepSeek's MLA
    rows and shared experts translated."""
    stored = read_state_dict(path, device)
    stored = hf_fp8.dequantize_state(stored, hf_fp8.block_size(path), source=str(path), dtype=dtype)
    method = hf_mxfp4.quant_method(path)  # GPT-OSS's MXFP4 experts
    stored = hf_mxfp4.dequantize_state(stored, method, source=str(path), dtype=dtype)
    stored = {k: v for k, v in stored.items() if not _IGNORED_KEYS.search(k)}
    stored = hf_moe.state_from_hf(stored)  # per-expert HF tensors -> stacked experts
    stored = hf_phi3.state_from_hf(stored, config)  # Phi-3's fused qkv / gate_up split
    stored = hf_gpt_oss.state_from_hf(stored, config)  # GPT-OSS's interleaved experts
    stored = hf_gemma3.state_from_hf(stored)  # a Gemma 3 vision-language model's text weights
    return hf_deepseek.state_from_hf(stored, config)  # MLA rotary rows, shared experts


def check_state(
    path: str | os.PathLike,
    expected: dict[str, torch.Tensor],
    stored: dict[str, torch.Tensor],
    note: str = "",
) -> None:
    """A CheckpointError naming ``path`` and the tensors when ``stored`` lacks one of
    ``expected``, has others, or has one of another shape (``note`` follows that message)."""
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_list(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_list(unexpected)}")
        raise CheckpointError(f"{path}: weights do not match config.json; " + "; ".join(parts))
    for key, ref in expected.items():
        if tuple(stored[key].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{path}: tensor {key} has shape {tuple(stored[key].shape)}, "
                f"config.json implies {tuple(ref.shape)}{note}"
            )


def load_pretrained(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Transformer:
    """Build a model from a directory; missing, unexpected or misshapen tensors are errors.

    `dtype=None` keeps the stored dtype (what an inference server wants); the model is
    built on the meta device and the tensors are assigned, so nothing is allocated twice.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    config = read_config(path)
    with torch.device("meta"):
        model = Transformer(config)
    expected = {to_hf_key(k): v for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    stored = read_hf_state(path, config, device, dtype)
    if config.tie_word_embeddings:
        stored.pop("lm_head.weight", None)
    check_state(path, expected, stored)
    state = {from_hf_key(k): (v.to(dtype) if dtype is not None else v) for k, v in stored.items()}
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    model.tie_weights()
    model.rotary.materialize(torch.device(device))
    return model.eval()


# ---------------------------------------------------------------------- saving
def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size: cannot parse {size!r} (use bytes or e.g. '2GB')")
    scale = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def _atomic_write_text(file: Path, text: str) -> None:
    tmp = file.with_name(f".{file.name}.tmp")
    try:
        with naming_full_disk(file, f"the previous {file.name} is intact"):
            tmp.write_text(text)
        publish(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)


def write_weights(
    state: dict[str, torch.Tensor], path: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
) -> list[str]:
    """Write ``state`` as safetensors files in ``path`` (sharded above ``max_shard_size``, with
    an index). Every shard is written under a temporary name first and all are renamed into
    place only once the last is complete, so a full disk (`astrai.files.DiskFullError`,
    naming the file) or a kill leaves an earlier save's weights whole; weight files of an
    earlier save are removed only after the new ones are in place. The files get the umask's
    mode (safetensors writes 0600). Returns the file names."""
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        nbytes = state[key].numel() * state[key].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = state[key]
        size += nbytes
    names = (
        [WEIGHTS_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    kept = (
        f"the weights already in {path} are intact"
        if any(path.glob("model*.safetensors"))
        else "no weights were written"
    )
    temps = [path / f".{name}.tmp" for name in names]
    try:
        for name, shard, tmp in zip(names, shards, temps):
            with naming_full_disk(path / name, kept):
                save_file(shard, str(tmp), metadata={"format": "pt"})
        for name, tmp in zip(names, temps):
            publish(tmp, path / name)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {key: name for name, shard in zip(names, shards) for key in shard},
        }
        _atomic_write_text(path / INDEX_NAME, json.dumps(index, indent=2))
    elif (path / INDEX_NAME).exists():
        (path / INDEX_NAME).unlink()
    for old in path.glob("model*.safetensors"):
        if old.name not in names:
            old.unlink()
    return names


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    *,
    tokenizer: AutoTokenizer | None = None,
    hf_format: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write `config.json`, safetensors weights (sharded above `max_shard_size`) and tokenizer.

    Each file is written under a temporary name and renamed into place with the mode a
    plain `open()` gives (other users can read what the umask lets them), and weight files
    of an earlier save are removed only after the new ones are complete, so an interrupted
    save or a full disk (`astrai.files.DiskFullError`, naming the file) never leaves a
    directory whose weights and config disagree.
    """
    if any("lora_" in name for name, _ in model.named_parameters()):
        raise ValueError(
            "save_pretrained: the model has unmerged LoRA adapters; call "
            "astrai.model.lora.merge_lora(model) first, or save the adapter with save_lora()"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    state = {}
    for name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = tensor.detach()
        if dtype is not None:
            t = t.to(dtype)
        state[to_hf_key(name)] = t.to("cpu").contiguous()
    stored_dtype = next(iter(state.values())).dtype
    state = hf_deepseek.state_to_hf(state, config, unstack=hf_format)  # MLA: DeepSeek layout
    state = hf_gpt_oss.state_to_hf(state, config)  # GPT-OSS: HF's expert layout, both formats
    if hf_format:  # stacked experts -> the per-expert tensors of HF checkpoints
        state = hf_moe.state_to_hf(state, hf_model_type(config))
        state = hf_phi3.state_to_hf(state, hf_model_type(config))  # fused qkv / gate_up

    names = write_weights(state, path, max_shard_size)

    if hf_format:
        data = config_to_hf(config, stored_dtype)
        generation = {k: data[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        _atomic_write_text(path / "generation_config.json", json.dumps(generation, indent=2))
        _atomic_write_text(path / CONFIG_NAME, json.dumps(data, indent=2))
    else:
        config.save(path / CONFIG_NAME)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    logger.info("saved model (%d tensors, %d file(s)) to %s", len(state), len(names), path)
    return path


class AutoModel:
    """Entry point mirroring `transformers.AutoModel`: `AutoModel.from_pretrained(path)`."""

    @staticmethod
    def from_pretrained(path: str | os.PathLike, **kwargs: Any) -> Transformer:
        return load_pretrained(path, **kwargs)
