"""Packed projections for inference: fewer, faster products for the engine.

A decoding step of a small model is a few rows through many small products. Two things
make them cheaper, both set up when an engine starts (`pack_projections`):

- **One product for the `Linear`s that read the same input**: q/k/v as one `[q + 2 kv,
  hidden]` weight, gate/up as one `[2 x intermediate, hidden]` weight, five products per
  layer become two. On the benchmark machine (one thread, astrai-30m's shapes) a 16-row
  q/k/v product went from 177 to 154 us and gate/up from 423 to 342 us.
- **Weights prepacked in oneDNN's blocked layout** (fp32 on the CPU, `rows` given: every
  pack above and every other `Linear`, o_proj, down_proj, the lm_head, MLA's): with a
  plain weight oneDNN reorders it on every call; prepacked, a 16 x 512 x 3072 product
  took 138 instead of 224 us (2 threads), bit-identical from 16 rows up
  (`astrai.extension.linear.prepack_weight`; experiments/bench/engine.md). Their products
  run at a bounded set of row counts (`astrai.extension.linear.row_bucket`), so that
  oneDNN's per-shape primitives do not grow a server's memory with every new batch size.

What it costs: the packs are copies. On the CPU with oneDNN that is one more copy of
every matmul weight of the model (the prepacked layouts; a cache-resident model also
keeps its plain q/k/v and gate/up concatenations for the products small enough for
`F.linear`); elsewhere (GPU, half precision) the q/k/v and gate/up concatenations only,
about two thirds of a dense layer's weights. `pack_projections` returns the bytes, the
engine logs them, and `packed_projections=False` saves them. Training keeps its own
parameters untouched and never reads a pack (gradients on). A pack is refreshed whenever
a source parameter changed (the tensor's version counter, which every in-place write, an
optimizer step or `load_state_dict`, bumps; a replaced tensor changes its address), so a
policy that trains while an engine shares it (GRPO) never generates with stale weights;
the concatenations are rewritten in place, so CUDA graphs that captured them keep their
address. A module whose sources were replaced (LoRA wrapping a projection) is no longer
served by its pack; a wrapped `Linear`'s own prepacked weight still serves the wrapper.

Quantized packs (`engine.quantization`, `astrai.extension.quantized`): every pack, q/k/v and
gate/up concatenated as before, and every other `Linear` but the LM head holds its weight as
int8 with per-channel scales and no fp32 copy; requantized, like the copies above, whenever a
source changed. Concatenating stays on: one int8 product for q/k/v ran about twice as fast
as three (experiments/bench/quantization.md).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

from torch import nn

from astrai.extension.quantized import int8_linear_vectorized
from astrai.model.layers import MLP, Attention, Linear, PackedLinear, mark_cache_resident

logger = logging.getLogger(__name__)


def _packable(modules: Iterator[nn.Module]) -> Iterator[tuple[nn.Module, str, tuple[Linear, ...]]]:
    for module in modules:
        if type(module) is Attention:
            yield module, "packed_qkv", (module.q_proj, module.k_proj, module.v_proj)
        elif isinstance(module, MLP):
            yield module, "packed_gate_up", (module.gate_proj, module.up_proj)


def prepack_rows(max_batch_size: int) -> int:
    """The product size oneDNN lays prepacked weights out for: the engine's decode batch,
    within 16-64 (a layout for a single row did not speed up anything; one for 16 or 64
    rows served 1 to 300 rows as well as the plain weight or better)."""
    return min(max(max_batch_size, 16), 64)


# How many engines use each model's packs: the last one to stop drops them.
_USERS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def pack_projections(
    model: nn.Module,
    rows: int | None = None,
    quantization: str | None = None,
    *,
    fuse: bool = True,
    keep_fp32: tuple[nn.Module, ...] = (),
) -> int:
    """Give every GQA attention a packed q/k/v and every SwiGLU MLP (shared experts
    included) a packed gate/up, for one more user (an engine); with `rows` (fp32 on the
    CPU with oneDNN) every other `Linear` gets its weight prepacked too, for products of
    about `rows` rows. With `quantization` every pack, and every other `Linear` but those of
    `keep_fp32`, holds its weight quantized (`astrai.extension.quantized`); `fuse=False`
    packs each `Linear` alone. Returns the bytes the packs hold. Layers whose projections
    are not plain `Linear`s (LoRA-wrapped) keep running them one by one.
    `release_projections` undoes it when the last user is done."""
    mark_cache_resident(model)  # a prepacked pack keeps its plain copy only for F.linear's
    device = next(model.parameters()).device
    if quantization and not int8_linear_vectorized(device):
        logger.warning(
            "%s: torch's int8 kernel is not vectorized on this CPU (AVX2 only): decoding will "
            "be slower than fp32 (experiments/bench/quantization.md)",
            quantization,
        )
    total, covered = 0, set()
    for module, name, sources in _packable(model.modules()) if fuse else ():
        pack = getattr(module, name, None)
        if (
            pack is None
            or not pack.serves(*sources)
            or pack.prepack_rows != rows
            or pack.quantization != quantization
        ):
            if not all(type(m) is Linear for m in sources):
                continue
            pack = PackedLinear(sources, rows, quantization)
            setattr(module, name, pack)
        covered.update(id(m) for m in sources)
        total += pack.nbytes
    kept = {id(m) for m in keep_fp32}
    for module in model.modules():
        quant = None if id(module) in kept else quantization
        if type(module) is not Linear or id(module) in covered or (rows is None and not quant):
            continue
        pack = module.pack
        if pack is None or pack.prepack_rows != rows or pack.quantization != quant:
            pack = PackedLinear((module,), rows, quant)
            if pack.prepacked is None and pack.qweight is None:  # no oneDNN route: no gain
                continue
            module.pack = pack
        total += pack.nbytes
    _USERS[model] = _USERS.get(model, 0) + 1
    what = f"quantized ({quantization})" if quantization else "packed"
    logger.info("%s the model's projections for inference: %.1f MiB", what, total / 2**20)
    return total


def _packs(model: nn.Module) -> Iterator[PackedLinear]:
    for module, name, _ in _packable(model.modules()):
        pack = getattr(module, name, None)
        if pack is not None:
            yield pack
    for module in model.modules():
        if isinstance(module, Linear) and module.pack is not None:
            yield module.pack


def refresh_packs(model: nn.Module) -> None:
    """Bring every pack of `model` up to date with its sources: a forward that Python does
    not run (a CUDA graph replay) cannot check them itself."""
    for pack in _packs(model):
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
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack = None


class ProjectionPacks:
    """One engine's hold on its model's packs: taken when the engine starts (`hold`), given
    up at its sleep and its shutdown (`release`), taken again at its wake-up, when the last
    user had dropped them, rebuilt from the weights of that moment. Holding twice or releasing
    twice changes nothing, so a shutdown after a sleep leaves other engines' packs alone."""

    def __init__(
        self,
        model: nn.Module,
        rows: int | None,
        quantization: str | None = None,
        *,
        fuse: bool = True,
        keep_fp32: tuple[nn.Module, ...] = (),
    ) -> None:
        self.model = model
        self.rows = rows
        self.quantization = quantization  # `pack_projections`' arguments
        self.fuse = fuse
        self.keep_fp32 = keep_fp32
        self.held = False
        self.nbytes = 0  # what the packs held at the last `hold`

    def hold(self) -> int:
        """Take the packs (`pack_projections`); the bytes they hold."""
        if not self.held:
            self.nbytes = pack_projections(
                self.model, self.rows, self.quantization, fuse=self.fuse, keep_fp32=self.keep_fp32
            )
            self.held = True
        return self.nbytes

    def release(self) -> int:
        """Give them up (`release_projections`: the last user drops them); the bytes they
        held (0 if this engine held none)."""
        if not self.held:
            return 0
        release_projections(self.model)
        self.held = False
        return self.nbytes


class NoPacks(ProjectionPacks):
    """`packed_projections=False`: the projections run one by one; nothing to hold."""

    def __init__(self) -> None:
        super().__init__(nn.Module(), None)

    def hold(self) -> int:
        return 0
