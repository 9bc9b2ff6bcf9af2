"""Packed projections for inference: one matmul for the `Linear`s that read the same input.

A decoding step of a small model is a few rows through many small products, and each
product pays oneDNN's per-call cost and reads its weight once per call. Packing q/k/v into
one `[q + 2 kv, hidden]` weight and gate/up into one `[2 x intermediate, hidden]` weight
turns five products per layer into two; on the benchmark machine (one thread, astrai-30m's
shapes) a 16-row q/k/v product went from 177 to 154 us and gate/up from 423 to 342 us
(experiments/bench/engine.md).

The packed weight is a copy, made when the engine starts (`pack_projections`): it costs
the bytes of the packed weights again, i.e. q/k/v and gate/up of every layer, about two
thirds of a dense model's non-embedding weights (`pack_projections` returns the figure and
the engine logs it). Training keeps its own parameters untouched. A pack is refreshed in
place whenever a source parameter changed (the version counter that every in-place write,
an optimizer step or `load_state_dict`, bumps; a replaced tensor changes its address), so
a policy that trains while an engine shares it (GRPO) never generates with stale weights,
and CUDA graphs that captured the packed weight keep its address. A module whose sources
were replaced (LoRA wrapping a projection) is no longer served by its pack.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

from torch import nn

from astrai.model.layers import MLP, Attention, Linear, PackedLinear

logger = logging.getLogger(__name__)


def _packable(modules: Iterator[nn.Module]) -> Iterator[tuple[nn.Module, str, tuple[Linear, ...]]]:
    for module in modules:
        if type(module) is Attention:
            yield module, "packed_qkv", (module.q_proj, module.k_proj, module.v_proj)
        elif isinstance(module, MLP):
            yield module, "packed_gate_up", (module.gate_proj, module.up_proj)


# How many engines use each model's packs: the last one to stop drops them.
_USERS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def pack_projections(model: nn.Module) -> int:
    """Give every GQA attention a packed q/k/v and every SwiGLU MLP (shared experts
    included) a packed gate/up, for one more user (an engine); returns the bytes the packs
    hold. Layers whose projections are not plain `Linear`s (LoRA-wrapped) keep running
    them one by one. `release_projections` undoes it when the last user is done."""
    total = 0
    for module, name, sources in _packable(model.modules()):
        pack = getattr(module, name, None)
        if pack is not None and pack.serves(*sources):
            total += pack.nbytes  # another engine packed them already
        elif all(type(m) is Linear for m in sources):
            pack = PackedLinear(sources)
            total += pack.nbytes
            setattr(module, name, pack)
    _USERS[model] = _USERS.get(model, 0) + 1
    logger.info("packed q/k/v and gate/up projections for inference: %.1f MiB", total / 2**20)
    return total


def refresh_packs(model: nn.Module) -> None:
    """Bring every pack of `model` up to date with its sources: a forward that Python does
    not run (a CUDA graph replay) cannot check them itself."""
    for module, name, _ in _packable(model.modules()):
        pack = getattr(module, name, None)
        if pack is not None:
            pack.refresh()


def release_projections(model: nn.Module) -> None:
    """One user fewer; the last drops the packs (their memory with them), and the
    projections run one by one again."""
    users = _USERS.get(model, 0) - 1
    if users > 0:
        _USERS[model] = users
        return
    _USERS.pop(model, None)
    for module, name, _ in _packable(model.modules()):
        setattr(module, name, None)
