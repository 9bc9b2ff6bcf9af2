"""Optimizers and learning-rate schedules: plain functions that Hydra configs point at.

An optimizer is a function `(model, **settings) -> Optimizer`, configured in
`conf/optim/NAME.yaml` with `_target_` and `_partial_: true`; `LMModule.configure_optimizers`
calls the partial with the policy model. Our functions exist (rather than `torch.optim.*`
targets) because they build parameter groups: weight decay on hidden matrices only, and
Muon's split into hidden matrices and the rest.

- `adamw`: AdamW with weight decay on matrices only (not on norms, biases, embeddings).
- `muon`: PyTorch's `torch.optim.Muon` for the 2-D hidden matrices (attention and MLP
  projections) and AdamW for everything else (embeddings, output head, norms, biases),
  as Muon's authors prescribe. The two are wrapped in one `CombinedOptimizer` so that
  Lightning's automatic optimisation, clipping, checkpointing and one LR schedule apply.
- `sgd`: SGD with momentum (the worked example of docs/training.md: one function, one YAML).

A schedule is a function `(total_steps, **settings) -> multiplier(step)` configured in
`conf/optim/schedule/NAME.yaml` (`cosine`, `wsd` = warmup-stable-decay, `constant`); the
multiplier drives a `LambdaLR` stepped once per optimizer step (`interval: step`), so it is
exact under gradient accumulation and resumes with the checkpoint.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

log = logging.getLogger(__name__)

__all__ = [
    "CombinedOptimizer",
    "adamw",
    "configure_optimizers",
    "constant",
    "cosine",
    "muon",
    "param_groups",
    "sgd",
    "split_params",
    "wsd",
]

#: `(model) -> Optimizer`: what a `conf/optim` partial becomes once Hydra instantiates it.
OptimizerFactory = Callable[[nn.Module], Optimizer]
#: `(total_steps=...) -> multiplier(step)`: what a `conf/optim/schedule` partial becomes.
ScheduleFactory = Callable[..., Callable[[int], float]]


# ---------------------------------------------------------------------- parameter groups
def split_params(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters by role: `hidden` 2-D matrices inside the blocks, `experts`
    (a MoE layer's stacked `[E, out, in]` expert matrices: decayed like hidden ones, but
    `torch.optim.Muon` takes 2-D parameters only), `embed` (embedding and output heads, the LM
    head or a reward model's `score`: Muon's orthogonalisation does not suit them), `other` (norms, biases, router bias, anything
    else). A tied head appears once."""
    out: dict[str, list[tuple[str, nn.Parameter]]] = {
        "hidden": [],
        "experts": [],
        "embed": [],
        "other": [],
    }
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if "embed" in name or name.startswith(("lm_head", "score.")) or ".lm_head" in name:
            out["embed"].append((name, p))
        elif p.ndim == 2:
            out["hidden"].append((name, p))
        elif p.ndim == 3:
            out["experts"].append((name, p))
        else:
            out["other"].append((name, p))
    if not any(out.values()):
        raise ValueError("optim: the model has no trainable parameters")
    return out


def param_groups(
    model: nn.Module,
    weight_decay: float = 0.0,
    embedding_weight_decay: float = 0.0,
    roles: Sequence[str] = ("hidden", "experts", "embed", "other"),
) -> list[dict[str, Any]]:
    """Named optimizer groups (`hidden`, `experts`, `embed`, `other`; empty ones left out):
    decay `weight_decay` on hidden and expert matrices, `embedding_weight_decay` on the
    embedding/head, none on norms and biases. The names show in the LR monitor (`lr/hidden`)."""
    parts = split_params(model)
    decay = {
        "hidden": weight_decay,
        "experts": weight_decay,
        "embed": embedding_weight_decay,
        "other": 0.0,
    }
    return [
        {"params": [p for _, p in parts[role]], "weight_decay": float(decay[role]), "name": role}
        for role in roles
        if parts[role]
    ]


# ---------------------------------------------------------------------- optimizers
def adamw(
    model: nn.Module,
    *,
    lr: float = 1e-3,
    betas: Sequence[float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    embedding_weight_decay: float = 0.0,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW over `param_groups(model, weight_decay, embedding_weight_decay)`."""
    return torch.optim.AdamW(
        param_groups(model, weight_decay, embedding_weight_decay),
        lr=float(lr),
        betas=(float(betas[0]), float(betas[1])),
        eps=float(eps),
        fused=fused,
    )


def muon(
    model: nn.Module,
    *,
    lr: float = 1e-3,
    betas: Sequence[float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    embedding_weight_decay: float = 0.0,
    fused: bool | None = None,
    muon_lr: float = 0.02,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    muon_weight_decay: float | None = None,
    adjust_lr_fn: str | None = None,
) -> Optimizer:
    """`torch.optim.Muon` (`muon_lr`, `momentum`, ...) on the hidden matrices and AdamW
    (`lr`, `betas`, ...) on the rest, as one `CombinedOptimizer`. `muon_weight_decay`
    defaults to `weight_decay`."""
    muon_cls = getattr(torch.optim, "Muon", None)
    if muon_cls is None:
        raise RuntimeError(
            "optim=muon needs torch.optim.Muon (PyTorch >= 2.9); "
            f"this is torch {torch.__version__}. Use optim=adamw."
        )
    hidden = param_groups(model, roles=("hidden",))
    optimizers: dict[str, Optimizer] = {}
    if hidden:
        optimizers["muon"] = muon_cls(
            [{"params": hidden[0]["params"], "name": "hidden"}],
            lr=float(muon_lr),
            weight_decay=float(weight_decay if muon_weight_decay is None else muon_weight_decay),
            momentum=float(momentum),
            nesterov=bool(nesterov),
            ns_steps=int(ns_steps),
            adjust_lr_fn=adjust_lr_fn,
        )
    rest = param_groups(
        model, weight_decay, embedding_weight_decay, roles=("experts", "embed", "other")
    )
    if rest:
        optimizers["adamw"] = torch.optim.AdamW(
            rest,
            lr=float(lr),
            betas=(float(betas[0]), float(betas[1])),
            eps=float(eps),
            fused=fused,
        )
    if list(optimizers) == ["muon"]:
        return optimizers["muon"]
    return CombinedOptimizer(optimizers)


def sgd(
    model: nn.Module,
    *,
    lr: float = 0.1,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    embedding_weight_decay: float = 0.0,
) -> torch.optim.SGD:
    """SGD with momentum over the same groups as `adamw` (decay on hidden matrices only)."""
    return torch.optim.SGD(
        param_groups(model, weight_decay, embedding_weight_decay),
        lr=float(lr),
        momentum=float(momentum),
        nesterov=bool(nesterov),
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
                f"expected {sorted(self.optimizers)} (was the optim config changed?)"
            )
        for k, o in self.optimizers.items():
            o.load_state_dict(inner[k])
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]


# ---------------------------------------------------------------------- schedules
def _warmup(step: int, warmup_steps: int) -> float | None:
    """Linear warmup multiplier `(step + 1) / warmup_steps`, or None once warmed up."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    return None


def _run_length(total_steps: int | None, name: str) -> int:
    if not total_steps:
        raise ValueError(
            f"optim.schedule ({name}) needs the run length: set trainer.max_steps "
            f"(or optim.schedule.total_steps)"
        )
    return int(total_steps)


def constant(total_steps: int | None = None, *, warmup_steps: int = 0) -> Callable[[int], float]:
    """Linear warmup, then 1 (the run length is not needed)."""
    warmup = max(int(warmup_steps), 0)
    return lambda step: _warmup(step, warmup) or 1.0


def cosine(
    total_steps: int | None, *, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> Callable[[int], float]:
    """Linear warmup, then cosine from 1 to `min_lr_ratio` at `total_steps`."""
    total = _run_length(total_steps, "cosine")
    warmup = max(int(warmup_steps), 0)

    def fn(step: int) -> float:
        w = _warmup(step, warmup)
        if w is not None:
            return w
        progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda progress: 1 - progress,
    "sqrt": lambda progress: 1 - math.sqrt(progress),
    "cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
}


def wsd(
    total_steps: int | None,
    *,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
    decay_steps: int | None = None,
    decay_fraction: float = 0.2,
    decay_shape: str = "linear",
) -> Callable[[int], float]:
    """Warmup-stable-decay: linear warmup, stable at 1, then decay (`decay_shape`: linear,
    sqrt or cosine) to `min_lr_ratio` over the last `decay_steps` (or `decay_fraction` of
    the run)."""
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(
            f"optim.schedule.decay_shape: {decay_shape!r} (choose one of {sorted(DECAY_SHAPES)})"
        )
    shape = DECAY_SHAPES[decay_shape]
    total = _run_length(total_steps, "wsd")
    warmup = max(int(warmup_steps), 0)
    n_decay = int(decay_steps) if decay_steps is not None else round(decay_fraction * total)
    n_decay = min(max(n_decay, 1), max(total - warmup, 1))
    decay_start = total - n_decay

    def fn(step: int) -> float:
        w = _warmup(step, warmup)
        if w is not None:
            return w
        if step < decay_start:
            return 1.0
        progress = min((step - decay_start + 1) / n_decay, 1.0)
        return min_lr_ratio + (1 - min_lr_ratio) * shape(progress)

    return fn


def configure_optimizers(
    model: nn.Module,
    optimizer: OptimizerFactory,
    schedule: ScheduleFactory | None = None,
    *,
    total_steps: int | None = None,
) -> dict[str, Any]:
    """Lightning's `configure_optimizers` value: `optimizer(model)` plus a per-step `LambdaLR`
    from `schedule(total_steps=...)` (default `constant`). A `total_steps` set in the
    schedule's config wins over `total_steps` here (the trainer's estimate)."""
    schedule = schedule or constant
    fixed = getattr(schedule, "keywords", {}).get("total_steps")  # a functools.partial's
    opt = optimizer(model)
    scheduler = LambdaLR(opt, schedule(total_steps=fixed or total_steps))
    return {
        "optimizer": opt,
        "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1, "name": "lr"},
    }
