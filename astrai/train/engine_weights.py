"""Which weights the run's live inference engine runs on: the live model itself, or a full
copy fed from FSDP2's shards (verl's sharding manager, in our own terms).

Under DDP or one process the engine runs on the live policy (:class:`LiveWeights`): a new
policy version costs nothing but the version bump. Under ``trainer=fsdp2`` every rank holds
only its shards, and the engine's cached forward calls the layers directly (FSDP2's hooks
that gather a unit's shards never run), so the engine runs on a plain, full-weight copy of
the policy (:class:`GatheredWeights`): built once from the model's config on the policy's
device, and per policy version refreshed parameter by parameter from the shards
(``DTensor.full_tensor()``, an all-gather), each gathered tensor copied in and freed before
the next. The peak is the shards, the copy and one parameter: never the whole model twice.

The gather is a collective: every rank runs it, in the same order, at the same points. The
rule for *whether* a point gathers is the same on every rank (the step is newer than the
last gathered one), so a rank that does not use the engine there (the evaluation callback
and the live policy server use it on rank 0 only) takes part through
:meth:`EngineWeights.refresh` without an engine; it keeps a copy too, so that a later user
on that rank (GRPO's rollouts run on every rank) starts from gathered weights.

The mode is chosen once, at the strategy's set-up (:func:`shard_companions`, called by
``FullyShardStrategy``), together with the sharding of the frozen reference policy.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from astrai.model import Transformer, inject_lora

log = logging.getLogger(__name__)

__all__ = [
    "EngineWeights",
    "GatheredWeights",
    "LiveWeights",
    "ShardedCompanions",
    "full_cpu_state",
    "fully_shard_units",
    "gather_into",
    "load_full_state",
    "shard_companions",
]


def _full(t: Tensor) -> Tensor:
    """The whole tensor: gathered from its shards (a collective) when it is a DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _device_of(t: Tensor) -> torch.device:
    return t.to_local().device if isinstance(t, DTensor) else t.device


@torch.no_grad()
def gather_into(live: nn.Module, copy: nn.Module | None) -> int:
    """Copy ``live``'s parameters and buffers into ``copy`` (same names), one tensor at a
    time: a sharded one is gathered, copied and freed before the next (``copy`` None: the
    gathers run and their results are dropped, for a rank without an engine). Every rank
    must call it with a model of the same structure. Returns the bytes gathered."""
    dest = dict(_tensors(copy)) if copy is not None else None
    total = 0
    for name, tensor in _tensors(live):
        full = _full(tensor.detach())
        total += full.numel() * full.element_size()
        if dest is not None:
            dest[name].copy_(full)
        del full
    return total


def _tensors(model: nn.Module) -> Iterable[tuple[str, Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


def full_cpu_state(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s state dict as whole CPU tensors, tensor by tensor. A sharded one is
    gathered (a collective every rank runs) and kept on rank 0 only, which writes the
    checkpoint: the other ranks' dicts leave it out, so no rank but one holds a whole
    copy in CPU memory."""
    out: dict[str, Tensor] = {}
    for key, value in module.state_dict().items():
        full = _full(value.detach())
        if not isinstance(value, DTensor) or torch.distributed.get_rank() == 0:
            out[key] = full.cpu().clone()
        del full
    return out


@torch.no_grad()
def load_full_state(module: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy whole tensors ``state`` (:func:`full_cpu_state`'s, from any number of ranks)
    into ``module``, whose tensors may be sharded (each rank keeps its own slice)."""
    ours = module.state_dict()
    if ours.keys() != state.keys():
        diff = sorted(set(ours) ^ set(state))[:5]
        raise ValueError(f"load_full_state: the state's keys differ from the module's, e.g. {diff}")
    for name, dest in ours.items():
        src = state[name]
        if isinstance(dest, DTensor):
            src = distribute_tensor(
                src.to(_device_of(dest), dest.dtype), dest.device_mesh, dest.placements
            )
        dest.copy_(src)


class EngineWeights(ABC):
    """What the engine runs on, and how a new policy version reaches it."""

    @abstractmethod
    def engine_model(self, live: nn.Module) -> nn.Module:
        """The model to build the engine on."""

    @abstractmethod
    def refresh(self, live: nn.Module, step: int) -> None:
        """Bring the engine's model up to ``live``'s weights of optimizer step ``step`` (a
        no-op where it already holds them). Collective where the weights are sharded."""

    def release(self) -> None:
        """Drop what the engine's model holds beyond the live one (the engine was closed)."""
        return None

    @abstractmethod
    def rank0_decides(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank where a refresh is a collective (whether rank 0
        syncs now: the others must join); this rank's own ``flag`` where it is not."""


class LiveWeights(EngineWeights):
    """DDP or one process: the engine runs on the live model; nothing to copy."""

    def engine_model(self, live: nn.Module) -> nn.Module:
        return live

    def refresh(self, live: nn.Module, step: int) -> None:
        return None

    def rank0_decides(self, flag: bool) -> bool:
        return flag


class GatheredWeights(EngineWeights):
    """FSDP2: the engine runs on a full copy (:attr:`copy`), refreshed from the shards once
    per policy version (:attr:`step`: the step whose weights it holds; None: never filled).
    """

    def __init__(self, lora: Any = None) -> None:
        self.lora = lora  # the policy's LoRAConfig (the copy carries the same adapters)
        self.copy: nn.Module | None = None
        self.step: int | None = None
        self.gathered_bytes = 0  # of the last refresh

    def engine_model(self, live: nn.Module) -> nn.Module:
        if self.copy is None:
            self.copy = plain_copy(live, self.lora)
            self.step = None  # filled at the next refresh
        return self.copy

    def refresh(self, live: nn.Module, step: int) -> None:
        if self.step is not None and step <= self.step:
            return
        copy = self.engine_model(live)
        copy.train(live.training)  # LoRA dropout as on the live model (DDP's engine)
        self.gathered_bytes = gather_into(live, copy)
        self.step = int(step)
        log.debug("engine weights gathered from the shards at step %d", step)

    def release(self) -> None:
        self.copy, self.step = None, None

    def rank0_decides(self, flag: bool) -> bool:
        said = [bool(flag)]
        torch.distributed.broadcast_object_list(said, src=0)
        return bool(said[0])


def plain_copy(live: nn.Module, lora: Any = None) -> nn.Module:
    """An unsharded model of ``live``'s config (with ``lora``'s adapters, a ``LoRAConfig``),
    allocated on ``live``'s device without being initialised (the first refresh fills it):
    no random draw, so the training RNG is left as it was."""
    first = next(live.parameters())
    device, dtype = _device_of(first), first.dtype
    with torch.device("meta"):
        copy = Transformer(live.config)
        if lora is not None:
            inject_lora(copy, lora)
    copy.to_empty(device=device)
    copy.to(dtype)
    copy.tie_weights()
    copy.rotary.materialize(device)
    copy.requires_grad_(False)
    ours = {n for n, _ in _tensors(copy)}
    theirs = {n for n, _ in _tensors(live)}
    if ours != theirs:
        diff = sorted(ours ^ theirs)[:5]
        raise ValueError(
            f"trainer=fsdp2: the engine's copy of the policy does not match it (e.g. {diff}); "
            "only astrai Transformers are supported"
        )
    return copy


# ---------------------------------------------------------------------- strategy set-up
class ShardedCompanions(ABC):
    """A LightningModule with more than its ``model`` to shard: its frozen reference, and the
    engine that must then run on gathered weights (``LMModule`` implements it)."""

    @abstractmethod
    def shard_companions(self, shard: Callable[[nn.Module], None]) -> None:
        """The policy was just sharded; ``shard(module)`` shards another model the same way."""


def fully_shard_units(model: nn.Module, units: tuple[type, ...], **options: Any) -> None:
    """``fully_shard`` every ``units`` instance of ``model`` and then its root, as the
    strategy shards the policy; a frozen model never runs backward, so its units always
    reshard after their forward (else no-grad forwards would leave them gathered)."""
    from torch.distributed.fsdp import fully_shard

    options = {**options, "reshard_after_forward": True}
    for unit in [m for m in model.modules() if isinstance(m, units)]:
        fully_shard(unit, **options)
    fully_shard(model, **options)


def shard_companions(pl_module: Any, units: tuple[type, ...], options: Mapping[str, Any]) -> None:
    """Called by ``FullyShardStrategy`` right after it sharded the policy: shard the rest of
    ``pl_module`` (its reference) with the same mesh and options, and feed its engine from
    the shards. A module that is not a :class:`ShardedCompanions` has nothing more."""
    if isinstance(pl_module, ShardedCompanions):
        pl_module.shard_companions(lambda m: fully_shard_units(m, units, **options))
