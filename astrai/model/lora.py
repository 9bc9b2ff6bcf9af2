"""Low-rank adapters (LoRA) for the projections of a `Transformer`.

The adapter files use PEFT's layout (`adapter_model.safetensors` with
`base_model.model.<hf name>.lora_A.weight` keys, and `adapter_config.json`), so adapters
trained here load in the PEFT ecosystem and vice versa.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from astrai.files import naming_full_disk, publish
from astrai.model.hub import CheckpointError, to_hf_key

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix: base_model.model.<hf name>.lora_A...


# The engine keeps each adapter's scaling in float32 (`astrai.inference.adapters`), and
# bf16 / fp16 models compute within float32's range: a larger scaling is inf.
_MAX_SCALING = torch.finfo(torch.float32).max
# A value quoted in an error is cut short: a hostile file's 10 MB string is not echoed back.
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_shown = _repr.repr


@dataclass
class LoRAConfig:
    """Rank, scale and which linear layers (by name suffix) get adapters."""

    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, Sequence) and not isinstance(self.target_modules, str):
            self.target_modules = list(self.target_modules)  # a Hydra ListConfig, a tuple
        problem = self.problem()
        if problem is not None:
            raise ValueError(f"LoRAConfig.{problem}")

    def problem(self) -> str | None:
        """What makes this config unusable, as `field: why` (None: nothing). Every field
        comes from a file or a command line: a wrong type or a scaling no float32 holds is
        refused here, before any tensor is built from it."""
        r, alpha, dropout = self.r, self.lora_alpha, self.lora_dropout
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            return f"r: must be a positive int, got {_shown(r)}"
        if not _is_finite_number(alpha):
            return f"lora_alpha: must be a finite number, got {_shown(alpha)}"
        if not _is_finite_number(dropout) or not 0.0 <= dropout < 1.0:
            return f"lora_dropout: must be a number in [0, 1), got {_shown(dropout)}"
        modules = self.target_modules
        if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
            return f"target_modules: must be a list of module names, got {_shown(modules)}"
        if not modules:
            return "target_modules: must name at least one module"
        if not isinstance(self.use_rslora, bool):
            return f"use_rslora: must be true or false, got {_shown(self.use_rslora)}"
        if abs(self.scaling) > _MAX_SCALING:
            return (
                f"lora_alpha: {alpha:.3g} gives a scaling of {self.scaling:.3g}, beyond float32's "
                f"range ({_MAX_SCALING:.3g})"
            )
        return None

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_peft(self) -> dict:
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": self.target_modules,
            "use_rslora": self.use_rslora,
            "bias": "none",
        }

    @classmethod
    def from_peft(cls, data: dict, *, source: str = ADAPTER_CONFIG) -> LoRAConfig:
        """The config of a PEFT `adapter_config.json` object; a ValueError names `source`
        and the field."""
        if data.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{source}: peft_type {data.get('peft_type')!r} is not LORA")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except ValueError as err:
            raise ValueError(f"{source}: {str(err).removeprefix('LoRAConfig.')}") from None


def _is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that is finite as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


class LoRALinear(nn.Module):
    """`base(x) + scaling * B(A(dropout(x)))` with the base layer frozen; B starts at zero."""

    def __init__(self, base_layer: nn.Linear, config: LoRAConfig) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.scaling = config.scaling
        factory = {"device": base_layer.weight.device, "dtype": base_layer.weight.dtype}
        self.lora_A = nn.Linear(base_layer.in_features, config.r, bias=False, **factory)
        self.lora_B = nn.Linear(config.r, base_layer.out_features, bias=False, **factory)
        self.dropout = nn.Dropout(config.lora_dropout) if config.lora_dropout else nn.Identity()
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        for p in self.base_layer.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots = getattr(self.base_layer, "lora", None)
        if slots is not None and slots.serving and not torch.is_grad_enabled():
            # An engine serves this adapter from its slots (`astrai.inference.adapters`):
            # the base layer adds each token's delta, the same path as served adapters.
            return self.base_layer(x)
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling

    def product_terms(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The base layer's ``(input, weight)`` pairs plus ``(scaling * A(dropout(x)), B)``:
        the output is the sum of their products (the chunked LM head, `astrai.model.head`,
        computes a LoRA-wrapped head block by block from them)."""
        low_rank = self.lora_A(self.dropout(x)) * self.scaling
        return [*self.base_layer.product_terms(x), (low_rank, self.lora_B.weight)]

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """The base layer with the low-rank update folded into its weight."""
        delta = (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling
        self.base_layer.weight += delta.to(self.base_layer.weight.dtype)
        return self.base_layer


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def inject_lora(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """Wrap every `nn.Linear` whose name ends in a target with a `LoRALinear`; freeze the rest."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    chosen = [
        n for n in linears if n.rsplit(".", 1)[-1] in config.target_modules and "lora_" not in n
    ]
    if not chosen:
        suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ValueError(
            f"LoRAConfig.target_modules {config.target_modules} match no linear layer; "
            f"available: {suffixes}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        _replace(model, name, LoRALinear(model.get_submodule(name), config))
    model.lora_config = config
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and restore plain `nn.Linear` layers."""
    names = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name in names:
        _replace(model, name, model.get_submodule(name).merged())
    for p in model.parameters():
        p.requires_grad_(True)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}


def save_lora(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write `adapter_model.safetensors` + `adapter_config.json` (PEFT layout)."""
    config = getattr(model, "lora_config", None)
    if config is None:
        raise ValueError("save_lora: the model has no LoRA adapters (call inject_lora first)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        PEFT_PREFIX + to_hf_key(n).replace(".base_layer", ""): t.to("cpu").contiguous()
        for n, t in lora_state_dict(model).items()
    }
    tmp = path / f".{ADAPTER_WEIGHTS}.tmp"
    with naming_full_disk(path / ADAPTER_WEIGHTS):
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    publish(tmp, path / ADAPTER_WEIGHTS)  # the umask's mode, not safetensors' 0600
    tmp = path / f".{ADAPTER_CONFIG}.tmp"
    with naming_full_disk(path / ADAPTER_CONFIG):
        tmp.write_text(json.dumps(config.to_peft(), indent=2))
    publish(tmp, path / ADAPTER_CONFIG)
    return path


def read_lora_dir(
    path: str | os.PathLike,
) -> tuple[LoRAConfig, dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT-layout adapter directory (ours or PEFT's): its config, the raw
    `adapter_config.json` (for keys `LoRAConfig` does not hold) and the tensors by PEFT key.
    A missing file is a FileNotFoundError, a bad config (not a JSON object, a field of the
    wrong type or range) a ValueError, a corrupt weights file a `CheckpointError`: each
    names the file. PEFT's regex form of `target_modules` (a string) reads as the modules
    the weights file adapts."""
    path = Path(path)
    cfg_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    for file in (cfg_file, weights):
        if not file.is_file():
            raise FileNotFoundError(f"LoRA adapter file not found: {file}")
    data = _read_config(cfg_file)
    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights}: corrupt or truncated safetensors file ({err})") from None
    fields = data
    if isinstance(data.get("target_modules"), str):
        fields = {**data, "target_modules": _adapted_suffixes(stored)}
    config = LoRAConfig.from_peft(fields, source=str(cfg_file))
    return config, data, stored


def _read_config(cfg_file: Path) -> dict[str, Any]:
    """The JSON object of `adapter_config.json`; anything else is a ValueError naming it."""
    try:
        data = json.loads(cfg_file.read_text())
    except RecursionError:
        raise ValueError(f"{cfg_file}: not valid JSON (nested too deeply)") from None
    except ValueError as err:  # bad JSON, bytes that are not UTF-8, an int of 5,000 digits
        raise ValueError(f"{cfg_file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(data).__name__}")
    return data


def _adapted_suffixes(stored: dict[str, torch.Tensor]) -> list[str]:
    """The module names (last part) that `stored`'s `...<module>.lora_A.weight` keys adapt."""
    modules = {k.rpartition(".lora_")[0].rpartition(".")[2] for k in stored if ".lora_" in k}
    return sorted(m for m in modules if m)


def load_lora(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Inject adapters described by `adapter_config.json` and load their weights."""
    weights = Path(path) / ADAPTER_WEIGHTS
    config, _, stored = read_lora_dir(path)
    if getattr(model, "lora_config", None) is None:
        inject_lora(model, config)
    expected = {}
    for name, param in lora_state_dict(model).items():
        key = PEFT_PREFIX + to_hf_key(name).replace(".base_layer", "")
        expected[key] = (name, param)
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{weights}: adapter does not match the model; missing: {missing[:10]}, "
            f"unexpected: {unexpected[:10]}"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, (name, param) in expected.items():
            if stored[key].shape != param.shape:
                raise CheckpointError(
                    f"{weights}: tensor {key} has shape {tuple(stored[key].shape)}, "
                    f"expected {tuple(param.shape)}"
                )
            params[name].copy_(stored[key])
    return model


__all__ = [
    "LoRAConfig",
    "LoRALinear",
    "inject_lora",
    "load_lora",
    "lora_state_dict",
    "merge_lora",
    "read_lora_dir",
    "save_lora",
]
