"""Many LoRA adapters over one base model: the registry and the device slots.

vLLM's and SGLang's model (S-LoRA / Punica): adapters are registered by name (up to
`max_cpu_loras`, their tensors on the host), and a batch may mix the base model and up to
`max_loras` of them, each in a device slot: per adapted projection one stack of A and one
of B transposed, ranks zero-padded to `max_lora_rank` (`astrai.extension.lora`). The
scheduler gives a request's adapter a slot when the request is admitted (`AdapterSlots.
acquire`), and releases it when the request ends; a slot whose adapter no running request
uses is taken over by another adapter, least recently used first. A request waits while
every slot is busy with other adapters. The scheduler only decides: the slots copy tensors
through these small interfaces, as the KV pool does.

A training run's own adapter (a policy wrapped by `astrai.model.inject_lora`: GRPO
rollouts, the evaluation callback, `serve_policy`) is the *live* adapter: one more adapter
whose tensors are the training module's, copied into its slot again on every versioned
weight update (`InferenceEngine.update_weights`), never merged; it serves requests that
name no adapter.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import reprlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from astrai.extension.lora import LoRABatch, LoRALayer, LoRAStep
from astrai.inference.task import Rejection, Task
from astrai.model.hub import from_hf_key
from astrai.model.layers import Linear
from astrai.model.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    LoRAConfig,
    LoRALinear,
    read_lora_dir,
)

logger = logging.getLogger(__name__)

NO_ADAPTERS = "this engine serves no LoRA adapters (start it with lora=..., engine.lora)"

# MLA decodes through kv_b_proj's absorbed weight, never its forward: no delta would apply.
_NOT_ADAPTABLE = ("kv_b_proj",)
LIVE_ADAPTER = "policy"  # the name a training run's live adapter is listed under


class AdapterError(ValueError):
    """An adapter that cannot be loaded or used; the message names the file or setting."""


class AdapterNotFound(AdapterError):
    """No adapter of that name is loaded (HTTP 404)."""


class AdapterInUse(AdapterError):
    """Queued or running requests use the adapter (unload refused)."""


@dataclass
class LoRASettings:
    """The engine's adapter limits (vLLM's names): `max_loras` adapters in one batch (device
    slots), `max_lora_rank` the highest rank accepted, `max_cpu_loras` adapters loaded at
    once (None: `max(max_loras, 8)`); loading beyond it is refused until one is unloaded."""

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine.lora.{name} must be a positive int, got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(self.max_loras, 8)
        cpu = self.max_cpu_loras
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(
                f"engine.lora.max_cpu_loras must be an int >= max_loras ({self.max_loras}), "
                f"got {cpu!r}"
            )

    @classmethod
    def of(cls, value: LoRASettings | Mapping | None) -> LoRASettings | None:
        if value is None or isinstance(value, LoRASettings):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"engine.lora must be a mapping or null, got {value!r}")
        unknown = sorted(set(value) - {"max_loras", "max_lora_rank", "max_cpu_loras"})
        if unknown:
            raise ValueError(
                f"engine.lora: unknown key(s) {unknown}; expected max_loras, max_lora_rank, "
                "max_cpu_loras"
            )
        return cls(**dict(value))


@dataclass(frozen=True)
class AdapterInfo:
    """What `/v1/models` and `list_adapters` show: `path` is "" for the live adapter; `uid`
    is new on every load (a reload under the same name is another adapter)."""

    name: str
    path: str
    rank: int
    uid: int


@dataclass(eq=False)
class Adapter:
    """A registered adapter: its info, scaling and per-module `(A [r, in], B [out, r])`
    (host tensors), or for the live adapter the training modules to read them from."""

    info: AdapterInfo
    scaling: float
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    live: dict[str, LoRALinear] | None = None

    def weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self.live is None:
            return self.tensors
        return {n: (m.lora_A.weight, m.lora_B.weight) for n, m in self.live.items()}


def adaptable_modules(model: nn.Module) -> dict[str, Linear]:
    """The projections adapters may target, by module name (a training wrapper's base layer
    under the wrapper's name): every `Linear` of the decoder blocks that runs its forward."""
    found = {}
    for name, module in model.named_modules():
        if type(module) is not Linear or not name.startswith("layers."):
            continue
        name = name.removesuffix(".base_layer")
        if name.rsplit(".", 1)[-1] not in _NOT_ADAPTABLE and ".lora_" not in name:
            found[name] = module
    return found


# PEFT keys the engine cannot honour (rank_pattern / alpha_pattern: per-module ranks and
# scalings; one scaling per adapter here): set to anything but null, false or {}, refused.
_UNSUPPORTED = ("use_dora", "lora_bias", "rank_pattern", "alpha_pattern")


def read_adapter(
    path: str | os.PathLike,
    shapes: Mapping[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype | None = None,
) -> tuple[LoRAConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The config and `(A, B)` per module name of a PEFT-layout adapter directory (ours or
    PEFT's), checked against the base's `shapes` (`{name: (in, out)}`) and `max_rank`, and
    cast to `dtype` (the engine's; None: as stored); an `AdapterError` names the file and
    what is wrong. A tensor with NaN or inf, or beyond `dtype`'s range, is refused: the
    engine must not serve an adapter that can only produce NaN."""
    try:
        config, data, stored = read_lora_dir(path)
    except (OSError, ValueError) as err:  # missing files, bad config, corrupt weights
        raise AdapterError(str(err)) from None
    cfg_file, weights = Path(path) / ADAPTER_CONFIG, Path(path) / ADAPTER_WEIGHTS
    for key in _UNSUPPORTED:
        if data.get(key) not in (None, False, {}):
            raise AdapterError(
                f"{cfg_file}: {key}={reprlib.repr(data[key])} is not supported by the engine"
            )
    if config.r > max_rank:
        raise AdapterError(
            f"{cfg_file}: rank r={config.r} is above the engine's max_lora_rank ({max_rank})"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in stored.items():
        body = from_hf_key(key.removeprefix(PEFT_PREFIX))
        module, _, part = body.rpartition(".lora_")
        if part not in ("A.weight", "B.weight") or not module:
            raise AdapterError(f"{weights}: tensor {key} is not a LoRA A/B weight")
        if module not in shapes:
            raise AdapterError(
                f"{weights}: tensor {key} targets {module}, which the base model has no "
                "adaptable projection for"
            )
        pairs.setdefault(module, {})[part[0]] = _checked(tensor, dtype, f"{weights}: tensor {key}")
    out = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights}: {module} has lora_A or lora_B, not both")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if a.shape != (config.r, fan_in) or b.shape != (fan_out, config.r):
            raise AdapterError(
                f"{weights}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base "
                f"model needs A ({config.r}, {fan_in}) and B ({fan_out}, {config.r}) (an "
                "adapter for another base model?)"
            )
        out[module] = (a, b)
    if not out:
        raise AdapterError(f"{weights}: no LoRA tensors")
    return config, out


def _checked(tensor: torch.Tensor, dtype: torch.dtype | None, what: str) -> torch.Tensor:
    """`tensor` in `dtype`, refused (naming `what`) unless floating-point and finite there."""
    if not tensor.is_floating_point():
        raise AdapterError(f"{what} has dtype {tensor.dtype}, not a floating-point type")
    if not torch.isfinite(tensor).all():
        raise AdapterError(f"{what} holds NaN or inf values")
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"{what} holds values beyond the range of the engine's {dtype}")
    return tensor


class AdapterSlots:
    """The device stacks of every adaptable projection and which adapter holds each slot.

    Used by the scheduler's thread only (acquire / release at admission and finish) and by
    the runner (`batch`); `EngineAdapters` serialises loads and unloads around them."""

    def __init__(self, model: nn.Module, settings: LoRASettings) -> None:
        self.settings = settings
        self.rank = settings.max_lora_rank
        n = settings.max_loras
        self.modules = adaptable_modules(model)
        ref = next(model.parameters())
        self.dtype = ref.dtype
        self.step = LoRAStep()
        self.layers: dict[str, LoRALayer] = {}
        for name, module in self.modules.items():
            a = torch.zeros(n * self.rank, module.in_features, dtype=ref.dtype, device=ref.device)
            bt = torch.zeros(n * self.rank, module.out_features, dtype=ref.dtype, device=ref.device)
            layer = LoRALayer(a, bt, self.rank, self.step)
            module.lora = layer
            self.layers[name] = layer
        self.scalings = torch.zeros(n, dtype=torch.float32, device=ref.device)
        self.host_scalings = [0.0] * n  # the same, on the host: no device sync per step
        self.holder: list[Adapter | None] = [None] * n
        self.users = [0] * n
        self._clock = itertools.count()
        self.last_used = [0] * n
        # acquire / release run on the engine's thread, evict on a server thread
        self.lock = threading.Lock()

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {n: (m.in_features, m.out_features) for n, m in self.modules.items()}

    def detach(self) -> None:
        """Take the hooks off the model (the engine stops)."""
        for module in self.modules.values():
            module.lora = None

    def slot_of(self, adapter: Adapter) -> int | None:
        for i, held in enumerate(self.holder):
            if held is adapter:
                return i
        return None

    def available(self, adapter: Adapter) -> bool:
        """Whether `acquire(adapter)` would succeed now."""
        with self.lock:
            return self.slot_of(adapter) is not None or 0 in self.users

    def acquire(self, adapter: Adapter) -> int | None:
        """A slot holding `adapter` for one more request (moved in if needed), or None while
        every slot serves other running requests."""
        with self.lock:
            slot = self.slot_of(adapter)
            if slot is None:
                idle = [i for i in range(len(self.holder)) if self.users[i] == 0]
                if not idle:
                    return None
                slot = min(idle, key=lambda i: (self.holder[i] is not None, self.last_used[i]))
                self.write(slot, adapter)
            self.users[slot] += 1
            self.last_used[slot] = next(self._clock)
            return slot

    def release(self, slot: int) -> None:
        with self.lock:
            self.users[slot] -= 1

    def evict(self, adapter: Adapter) -> None:
        """Forget `adapter`'s slot (it is unloaded; no request uses it)."""
        with self.lock:
            slot = self.slot_of(adapter)
            if slot is not None:
                self.holder[slot] = None

    @torch.no_grad()
    def write(self, slot: int, adapter: Adapter) -> None:
        """Copy `adapter`'s tensors into `slot` (zeros for the projections it leaves alone).
        The slot holds no adapter until the copy is complete: one that fails halfway leaves
        an empty slot, never a former holder over partly overwritten tensors."""
        self.holder[slot] = None
        r0, r1 = slot * self.rank, (slot + 1) * self.rank
        weights = adapter.weights()
        for name, layer in self.layers.items():
            layer.a[r0:r1].zero_()
            layer.bt[r0:r1].zero_()
            pair = weights.get(name)
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                layer.a[r0 : r0 + r].copy_(a)
                layer.bt[r0 : r0 + r].copy_(b.t())
        self.scalings[slot] = adapter.scaling
        self.host_scalings[slot] = adapter.scaling
        self.holder[slot] = adapter

    def refresh(self, adapter: Adapter) -> None:
        """Re-read `adapter`'s tensors into its slot, if it has one (new live weights)."""
        slot = self.slot_of(adapter)
        if slot is not None:
            self.write(slot, adapter)

    def batch(self, token_slots: list[int]) -> LoRABatch:
        return LoRABatch.build(
            token_slots, self.scalings, self.rank, self.scalings.device, self.host_scalings
        )

    def active(self, tasks: Sequence[Task]) -> bool:
        """Whether a row of a step runs with an adapter (then it runs eagerly, `applied`)."""
        return any(t.adapter_slot >= 0 for t in tasks)

    @contextlib.contextmanager
    def applied(self, tasks: Sequence[Task], q_lens: Sequence[int]) -> Iterator[None]:
        """The adapted projections add each token's adapter (row `i` feeds `q_lens[i]`
        tokens of `tasks[i]`) for the forward run in the block."""
        self.step.batch = self.batch(
            [t.adapter_slot for t, q in zip(tasks, q_lens) for _ in range(q)]
        )
        try:
            yield
        finally:
            self.step.batch = None


class NoAdapterSlots:
    """The slots of an engine that serves no adapters: no request ever holds one (its tasks
    have no adapter, so admission never asks for a slot)."""

    def active(self, tasks: Sequence[Task]) -> bool:
        return False

    def available(self, adapter: Adapter) -> bool:
        return False

    def acquire(self, adapter: Adapter) -> int | None:
        return None

    def release(self, slot: int) -> None:
        """Nothing is held."""


NO_ADAPTER_SLOTS = NoAdapterSlots()  # stateless: one serves every engine without adapters


class EngineAdapters:
    """The adapters an engine serves, by name, over its `AdapterSlots`; thread-safe (loads
    and unloads come from server threads while the engine runs)."""

    enabled = True

    @classmethod
    def build(
        cls, model: nn.Module, lora: LoRASettings | Mapping | None
    ) -> EngineAdapters | NoAdapters:
        """The engine's adapters: `NoAdapters` without `lora` settings unless `model` carries
        a training run's adapters, which become the live adapter (rank limit: theirs)."""
        settings = LoRASettings.of(lora)
        config = getattr(model, "lora_config", None)
        if settings is None and config is None:
            return NoAdapters()
        if settings is None:
            settings = LoRASettings(max_loras=1, max_lora_rank=config.r)
        adapters = cls(AdapterSlots(model, settings))
        if config is not None:
            adapters.register_live(model)
        return adapters

    def __init__(self, slots: AdapterSlots) -> None:
        self.slots = slots
        self.settings = slots.settings
        self.lock = threading.RLock()
        self.by_name: dict[str, Adapter] = {}
        self.default: Adapter | None = None
        self._uids = itertools.count(1)

    def load(self, name: str, path: str | os.PathLike) -> AdapterInfo:
        if not isinstance(name, str) or not name.strip():
            raise AdapterError(f"adapter name must be a non-empty string, got {name!r}")
        with self.lock:
            self._check_room(name)
        slots = self.slots
        config, tensors = read_adapter(path, slots.shapes, self.settings.max_lora_rank, slots.dtype)
        info = AdapterInfo(name=name, path=str(path), rank=config.r, uid=next(self._uids))
        adapter = Adapter(info, config.scaling, tensors)
        with self.lock:  # again: another load may have come in while the files were read
            self._check_room(name)
            self.by_name[name] = adapter
        logger.info("loaded LoRA adapter %r (rank %d) from %s", name, config.r, path)
        return info

    def _check_room(self, name: str) -> None:
        """A new adapter `name` may be registered (the caller holds the lock)."""
        if name in self.by_name:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        limit = self.settings.max_cpu_loras
        if len(self.by_name) >= limit:
            raise AdapterError(
                f"cannot load {name!r}: {limit} adapters are loaded, the engine's "
                f"max_cpu_loras; unload one first"
            )

    def register_live(self, model: nn.Module) -> Adapter:
        """The training run's own adapter (`inject_lora`'s wrappers in `model`), which
        requests naming no adapter use."""
        config: LoRAConfig = model.lora_config
        problem = config.problem()  # fields set after the config was built are checked too
        if problem is not None:
            raise AdapterError(f"the policy's LoRA config: {problem}")
        if config.r > self.settings.max_lora_rank:
            raise AdapterError(
                f"the policy's LoRA rank {config.r} is above max_lora_rank "
                f"({self.settings.max_lora_rank})"
            )
        # Projections the slots cannot serve (MLA's absorbed kv_b_proj) keep their wrapper's
        # own forward, which adds the adapter there.
        live = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, LoRALinear) and name in self.slots.layers
        }
        info = AdapterInfo(name=LIVE_ADAPTER, path="", rank=config.r, uid=next(self._uids))
        adapter = Adapter(info, config.scaling, live=live)
        with self.lock:
            self.by_name[LIVE_ADAPTER] = adapter
            self.default = adapter
        return adapter

    def unload(self, name: str, in_use: Callable[[Adapter], bool]) -> None:
        """Forget `name`; refused while `in_use(adapter)` (queued or running requests)."""
        with self.lock:
            adapter = self.resolve(name)
            if adapter is None or adapter is self.default:
                raise AdapterError(f"adapter {name!r} is the training run's live adapter")
            if in_use(adapter):
                raise AdapterInUse(
                    f"adapter {name!r} is in use by queued or running requests; unload it "
                    "when they have finished"
                )
            del self.by_name[name]
            self.slots.evict(adapter)
        logger.info("unloaded LoRA adapter %r", name)

    def close(self) -> None:
        """Take the slots' hooks off the model (the engine stops)."""
        self.slots.detach()

    def refresh_live(self) -> None:
        """Copy the live adapter's current tensors into its slot (a weight update)."""
        if self.default is not None:
            self.slots.refresh(self.default)

    def resolve(self, name: str | None) -> Adapter | None:
        """The adapter a request names (None: the default, the live adapter or the base)."""
        if name is None:
            return self.default
        adapter = self.by_name.get(name)
        if adapter is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded")
        return adapter

    def list(self) -> list[AdapterInfo]:
        with self.lock:
            return [a.info for a in self.by_name.values()]

    def assign(self, tasks: Sequence[Task]) -> Rejection | None:
        """Give the tasks of one prompt their adapter (None: the base, or a training run's
        live adapter); a `Rejection` if it was unloaded since the request was checked.
        The caller holds `lock` from the resolution to the queueing (no unload between)."""
        try:
            adapter = self.resolve(tasks[0].params.adapter)
        except AdapterNotFound as err:
            return Rejection(str(err), param="adapter")
        for task in tasks:
            task.adapter = adapter
        return None


class NoAdapters:
    """The registry of an engine that serves no adapters (as `NoPrefixCache` is the prefix
    cache that shares nothing): every request runs the base model, a request naming an
    adapter is `AdapterNotFound`, and loading or unloading one is an `AdapterError`."""

    enabled = False
    default: Adapter | None = None

    def __init__(self) -> None:
        self.slots = NO_ADAPTER_SLOTS
        self.lock = contextlib.nullcontext()

    def load(self, name: str, path: str | os.PathLike) -> AdapterInfo:
        raise AdapterError(NO_ADAPTERS)

    def unload(self, name: str, in_use: Callable[[Adapter], bool]) -> None:
        raise AdapterError(NO_ADAPTERS)

    def list(self) -> list[AdapterInfo]:
        return []

    def resolve(self, name: str | None) -> Adapter | None:
        if name is None:
            return None
        raise AdapterNotFound(f"adapter {name!r}: {NO_ADAPTERS}")

    def assign(self, tasks: Sequence[Task]) -> Rejection | None:
        """Requests were checked (`resolve`): they name no adapter and run the base."""
        return None

    def refresh_live(self) -> None:
        """No live adapter."""

    def close(self) -> None:
        """Nothing hooked into the model."""


__all__ = [
    "LIVE_ADAPTER",
    "NO_ADAPTERS",
    "NO_ADAPTER_SLOTS",
    "Adapter",
    "AdapterError",
    "AdapterInUse",
    "AdapterInfo",
    "AdapterNotFound",
    "AdapterSlots",
    "EngineAdapters",
    "LoRASettings",
    "NoAdapterSlots",
    "NoAdapters",
    "adaptable_modules",
    "read_adapter",
]
