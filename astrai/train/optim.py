"""Optimizers and learning-rate schedules, built from the `optim` config group.

- `adamw`: AdamW with weight decay on matrices only (not on norms, biases, embeddings).
- `muon`: PyTorch's `torch.optim.Muon` for the 2-D hidden matrices (attention and MLP
  projections) and AdamW for everything else (embeddings, output head, norms, biases),
  as Muon's authors prescribe. The two are wrapped in one `CombinedOptimizer` so that
  Lightning's automatic optimisation, clipping, checkpointing and one LR schedule apply.

Schedules (`cosine`, `wsd` = warmup-stable-decay, `constant`) are `LambdaLR` multipliers
stepped once per optimizer step (`interval: step`), so they are exact under gradient
accumulation and resume with the checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

log = logging.getLogger(__name__)

__all__ = [
    "CombinedOptimizer",
    "build_optimizer",
    "configure_optimizers",
    "lr_lambda",
    "split_params",
]

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")


# ---------------------------------------------------------------------- parameter groups
def split_params(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters by role: `hidden` 2-D matrices inside the blocks, `embed`
    (embedding and output head: Muon's orthogonalisation does not suit them), `other`
    (norms, biases, anything not 2-D). A tied head appears once."""
    out: dict[str, list[tuple[str, nn.Parameter]]] = {"hidden": [], "embed": [], "other": []}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if "embed" in name or name.startswith("lm_head") or ".lm_head" in name:
            out["embed"].append((name, p))
        elif p.ndim == 2:
            out["hidden"].append((name, p))
        else:
            out["other"].append((name, p))
    return out


def _adamw(groups: list[dict[str, Any]], cfg: Mapping[str, Any]) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=float(cfg.get("lr", 1e-3)),
        betas=tuple(cfg.get("betas", (0.9, 0.95))),
        eps=float(cfg.get("eps", 1e-8)),
        fused=bool(cfg["fused"]) if cfg.get("fused") is not None else None,
    )


def build_optimizer(model: nn.Module, cfg: Mapping[str, Any]) -> Optimizer:
    """The optimizer named by `cfg["name"]` over the model's trainable parameters."""
    name = str(cfg.get("name", "adamw")).lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name: unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
    parts = split_params(model)
    wd = float(cfg.get("weight_decay", 0.0))
    embed_wd = float(cfg.get("embedding_weight_decay", 0.0))
    if not any(parts.values()):
        raise ValueError("optim: the model has no trainable parameters")
    if name == "adamw":
        groups = [
            {"params": [p for _, p in parts["hidden"]], "weight_decay": wd, "name": "hidden"},
            {"params": [p for _, p in parts["embed"]], "weight_decay": embed_wd, "name": "embed"},
            {"params": [p for _, p in parts["other"]], "weight_decay": 0.0, "name": "other"},
        ]
        return _adamw(groups, cfg)
    muon_cls = getattr(torch.optim, "Muon", None)
    if muon_cls is None:
        raise RuntimeError(
            "optim.name=muon needs torch.optim.Muon (PyTorch >= 2.9); "
            f"this is torch {torch.__version__}. Use optim=adamw."
        )
    mcfg = dict(cfg.get("muon") or {})
    optimizers: dict[str, Optimizer] = {}
    if parts["hidden"]:
        optimizers["muon"] = muon_cls(
            [{"params": [p for _, p in parts["hidden"]], "name": "hidden"}],
            lr=float(mcfg.get("lr", 0.02)),
            weight_decay=float(mcfg.get("weight_decay", wd)),
            momentum=float(mcfg.get("momentum", 0.95)),
            nesterov=bool(mcfg.get("nesterov", True)),
            ns_steps=int(mcfg.get("ns_steps", 5)),
            adjust_lr_fn=mcfg.get("adjust_lr_fn"),
        )
    rest = [
        {"params": [p for _, p in parts["embed"]], "weight_decay": embed_wd, "name": "embed"},
        {"params": [p for _, p in parts["other"]], "weight_decay": 0.0, "name": "other"},
    ]
    if any(g["params"] for g in rest):
        optimizers["adamw"] = _adamw(rest, cfg)
    return (
        optimizers["muon"]
        if len(optimizers) == 1 and "muon" in optimizers
        else (CombinedOptimizer(optimizers))
    )


# ---------------------------------------------------------------------- combined optimizer
class _StateView(MutableMapping):
    """`optimizer.state` of a `CombinedOptimizer`: reads and writes go to the child that
    owns the parameter (Lightning moves state tensors between devices through it)."""

    def __init__(self, optimizers: Mapping[str, Optimizer]) -> None:
        self._opts = list(optimizers.values())

    def _owner(self, key: Any) -> Optimizer:
        for opt in self._opts:
            if key in opt.state:
                return opt
        for opt in self._opts:
            if any(key is p for g in opt.param_groups for p in g["params"]):
                return opt
        raise KeyError(key)

    def __getitem__(self, key: Any) -> Any:
        return self._owner(key).state[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._owner(key).state[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._owner(key).state[key]

    def __iter__(self) -> Iterator[Any]:
        for opt in self._opts:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._opts)


class CombinedOptimizer(Optimizer):
    """Several optimizers over disjoint parameters, stepped as one.

    `param_groups` are the children's own group dicts (so one `LambdaLR` scales every
    group's lr from its own base), and `state_dict` nests the children's, so a Lightning
    checkpoint restores each exactly.
    """

    def __init__(self, optimizers: Mapping[str, Optimizer]) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers = dict(optimizers)
        params = [p for o in self.optimizers.values() for g in o.param_groups for p in g["params"]]
        super().__init__(params, defaults={})
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]
        self.state = _StateView(self.optimizers)  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={type(o).__name__}" for k, o in self.optimizers.items())
        return f"CombinedOptimizer({inner})"

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": {k: o.state_dict() for k, o in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = state_dict.get("optimizers")
        if not isinstance(inner, Mapping) or set(inner) != set(self.optimizers):
            raise ValueError(
                f"CombinedOptimizer: checkpoint holds optimizers "
                f"{sorted(inner) if isinstance(inner, Mapping) else inner!r}, "
                f"expected {sorted(self.optimizers)} (was optim.name changed?)"
            )
        for k, o in self.optimizers.items():
            o.load_state_dict(inner[k])
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]


# ---------------------------------------------------------------------- schedules
def lr_lambda(
    name: str,
    *,
    total_steps: int | None,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
    decay_steps: int | None = None,
    decay_fraction: float = 0.2,
    decay_shape: str = "linear",
) -> Callable[[int], float]:
    """Multiplier of the base lr at optimizer step `step` (0-based).

    - `constant`: linear warmup, then 1.
    - `cosine`: linear warmup, then cosine from 1 to `min_lr_ratio` at `total_steps`.
    - `wsd`: linear warmup, stable at 1, then decay (linear or `sqrt`/`cosine`) to
      `min_lr_ratio` over the last `decay_steps` (or `decay_fraction` of the run).
    """
    name = name.lower()
    if name not in SCHEDULES:
        raise ValueError(
            f"optim.schedule.name: unknown schedule {name!r}; choose one of {SCHEDULES}"
        )
    warmup = max(int(warmup_steps), 0)
    if name != "constant" and not total_steps:
        raise ValueError(
            f"optim.schedule.name={name} needs the run length: set trainer.max_steps "
            f"(or optim.schedule.total_steps)"
        )
    total = int(total_steps or 0)

    def warm(step: int) -> float | None:
        if warmup and step < warmup:
            return (step + 1) / warmup
        return None

    if name == "constant":
        return lambda step: warm(step) or 1.0

    if name == "cosine":

        def cosine(step: int) -> float:
            w = warm(step)
            if w is not None:
                return w
            progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return cosine

    n_decay = int(decay_steps) if decay_steps is not None else round(decay_fraction * total)
    n_decay = min(max(n_decay, 1), max(total - warmup, 1))
    decay_start = total - n_decay

    def wsd(step: int) -> float:
        w = warm(step)
        if w is not None:
            return w
        if step < decay_start:
            return 1.0
        progress = min((step - decay_start + 1) / n_decay, 1.0)
        if decay_shape == "sqrt":
            frac = 1 - math.sqrt(progress)
        elif decay_shape == "cosine":
            frac = 0.5 * (1 + math.cos(math.pi * progress))
        elif decay_shape == "linear":
            frac = 1 - progress
        else:
            raise ValueError(f"optim.schedule.decay_shape: {decay_shape!r} (linear|sqrt|cosine)")
        return min_lr_ratio + (1 - min_lr_ratio) * frac

    return wsd


def configure_optimizers(
    model: nn.Module, cfg: Mapping[str, Any], *, total_steps: int | None = None
) -> dict[str, Any]:
    """Lightning's `configure_optimizers` return value: optimizer + per-step `LambdaLR`."""
    cfg = dict(cfg)
    optimizer = build_optimizer(model, cfg)
    sched = dict(cfg.get("schedule") or {"name": "constant"})
    name = sched.pop("name", "constant")
    total = sched.pop("total_steps", None) or total_steps
    fn = lr_lambda(name, total_steps=total, **sched)
    scheduler = LambdaLR(optimizer, fn)
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1, "name": "lr"},
    }
