"""The replica's side of a weight update: what may be written, the checks before anything
is read, and the copy, one tensor at a time.

An update names tensors (`names`, `shapes`, `dtypes`). `ModelTargets` are the served
model's tensors under `model.state_dict()`'s names (`embed_tokens.weight`,
`layers.0.self_attn.q_proj.weight`, ...; `save_pretrained`'s `model.`-prefixed names are
read as the same; with tied embeddings `lm_head.weight` is the embedding, and either name
writes it); `AdapterTargets` are a loaded LoRA adapter's A and B (`lora_name`; the
trainer's `layers.0.self_attn.q_proj.lora_A.weight`, or PEFT's
`base_model.model.model.layers...` as `save_lora` writes them). Any subset of the targets
may be updated; every name must exist with the same shape and dtype, or the update is
refused (`WeightProblem`, naming the first bad name) before a byte of tensor data is read.

Then tensors arrive one by one (a broadcast into one buffer, or `safe_open`'s
`get_tensor`), each copied into its target and dropped before the next: the model is
never held twice. In-place copies bump the parameters' version counters, so the engine's
packed projections refresh themselves (`astrai.model.packed`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from astrai.inference.adapters import Adapter, AdapterError
from astrai.model.hub import CheckpointError, from_hf_key, weight_files
from astrai.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, LoRAConfig
from astrai.remote.wire import dtype_name

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.remote.weight_group import WeightGroup

logger = logging.getLogger(__name__)

# safetensors' header dtype codes -> torch's names
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class WeightProblem(ValueError):
    """An update refused before anything was written (HTTP 400); names the first bad
    name, or the field at fault."""


@dataclass(frozen=True)
class Entry:
    """One tensor of an update, as announced: name, shape and dtype (torch's name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def entries_of(names: object, shapes: object, dtypes: object) -> list[Entry]:
    """The announced tensors of a request body; a WeightProblem naming the field when the
    three lists do not line up or hold something else than names, shapes and dtypes."""
    for field, value in (("names", names), ("shapes", shapes), ("dtypes", dtypes)):
        if not isinstance(value, list):
            raise WeightProblem(f"{field}: must be a list, got {type(value).__name__}")
    assert isinstance(names, list) and isinstance(shapes, list) and isinstance(dtypes, list)
    if not names:
        raise WeightProblem("names: empty; an update names at least one tensor")
    if not len(names) == len(shapes) == len(dtypes):
        raise WeightProblem(
            f"names, shapes, dtypes: {len(names)}, {len(shapes)} and {len(dtypes)} entries; "
            "one of each per tensor"
        )
    out, seen = [], set()
    for i, (name, shape, dtype) in enumerate(zip(names, shapes, dtypes)):
        if not isinstance(name, str) or not name:
            raise WeightProblem(f"names[{i}]: must be a tensor name, got {name!r}")
        if name in seen:
            raise WeightProblem(f"names[{i}]: {name} is named twice")
        seen.add(name)
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WeightProblem(f"shapes[{i}]: must be a list of sizes, got {shape!r}")
        if not isinstance(dtype, str):
            raise WeightProblem(f"dtypes[{i}]: must be a dtype name, got {dtype!r}")
        out.append(Entry(name, tuple(shape), dtype.removeprefix("torch.")))
    return out


class ModelTargets:
    """The served model's tensors, by `state_dict()` name."""

    what = "the model"

    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors = dict(model.state_dict(keep_vars=True))
        self.written = 0  # tensors copied in so far (a failure after one leaves a mix)

    def key(self, name: str) -> str:
        return from_hf_key(name)

    def target(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(self.key(name))

    @torch.no_grad()
    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.written += 1
        self.tensors[self.key(name)].copy_(tensor)

    def finish(self) -> None:
        """Nothing: the packs follow the parameters' version counters."""


class AdapterTargets:
    """A loaded LoRA adapter's A `[r, in]` and B `[out, r]` per projection."""

    def __init__(self, engine: InferenceEngine, name: str) -> None:
        try:
            adapter = engine.adapters.resolve(name)
        except AdapterError as err:
            raise WeightProblem(f"lora_name: {err}") from None
        if adapter is None or not adapter.tensors:
            raise WeightProblem(f"lora_name: {name!r} is not an adapter loaded from a directory")
        self.adapter: Adapter = adapter
        self.engine = engine
        self.what = f"LoRA adapter {name!r}"
        self.written = 0

    def key(self, name: str) -> tuple[str, int] | None:
        body = from_hf_key(name.removeprefix(PEFT_PREFIX)).replace(".base_layer", "")
        module, _, part = body.rpartition(".lora_")
        if part not in ("A.weight", "B.weight") or module not in self.adapter.tensors:
            return None
        return module, 0 if part[0] == "A" else 1

    def target(self, name: str) -> torch.Tensor | None:
        key = self.key(name)
        return None if key is None else self.adapter.tensors[key[0]][key[1]]

    @torch.no_grad()
    def write(self, name: str, tensor: torch.Tensor) -> None:
        target = self.target(name)
        assert target is not None
        self.written += 1
        target.copy_(tensor)

    def finish(self) -> None:
        """Copy the new A and B into the adapter's device slot, if it holds one."""
        self.engine.adapters.slots.refresh(self.adapter)

    def check_config(self, path: Path) -> None:
        """`adapter_config.json` of `path` has this adapter's rank and scaling (the scaling
        is the adapter's, not its weights': another one is another adapter)."""
        file = path / ADAPTER_CONFIG
        try:
            config = LoRAConfig.from_peft(json.loads(file.read_text()), source=str(file))
        except (OSError, ValueError) as err:
            raise WeightProblem(f"model_path: {err}") from None
        info = self.adapter.info
        if config.r != info.rank or config.scaling != self.adapter.scaling:
            raise WeightProblem(
                f"model_path: {file} has rank {config.r} and scaling {config.scaling:g}; "
                f"{self.what} has rank {info.rank} and scaling {self.adapter.scaling:g} "
                "(load it as a new adapter instead)"
            )


Targets = ModelTargets | AdapterTargets


def targets_for(engine: InferenceEngine, lora_name: str | None) -> Targets:
    if lora_name is None:
        return ModelTargets(engine.model)
    if not isinstance(lora_name, str) or not lora_name:
        raise WeightProblem(f"lora_name: must be an adapter's name or null, got {lora_name!r}")
    return AdapterTargets(engine, lora_name)


def check_entries(targets: Targets, entries: Sequence[Entry]) -> None:
    """A WeightProblem naming the first entry that `targets` has not, or has with another
    shape or dtype."""
    for e in entries:
        target = targets.target(e.name)
        if target is None:
            raise WeightProblem(f"names: {e.name} is not a tensor of {targets.what}")
        if tuple(target.shape) != e.shape:
            raise WeightProblem(
                f"shapes: {e.name} has shape {list(target.shape)} in {targets.what}, "
                f"got {list(e.shape)}"
            )
        if dtype_name(target.dtype) != e.dtype:
            raise WeightProblem(
                f"dtypes: {e.name} is {dtype_name(target.dtype)} in {targets.what}, got {e.dtype}"
            )


def check_version(version: object, current: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool):
        raise WeightProblem(f"policy_version: must be an int, got {version!r}")
    if version <= current:
        raise WeightProblem(
            f"policy_version: {version} is not greater than the replica's current version "
            f"{current}; new weights are a new policy"
        )
    return version


# ---------------------------------------------------------------------- sources
def receive(group: WeightGroup, targets: Targets, entries: Sequence[Entry]) -> None:
    """Each announced tensor by broadcast from rank 0 into one buffer, copied into its
    target, dropped before the next."""
    for e in entries:
        target = targets.target(e.name)
        assert target is not None
        buffer = torch.empty(e.shape, dtype=target.dtype, device=group.device)
        group.broadcast(buffer)
        targets.write(e.name, buffer)
        del buffer
    targets.finish()


class DiskWeights:
    """The tensors of a safetensors directory: a `save_pretrained` model (one file or an
    index and its shards) or, for an adapter, a PEFT directory's `adapter_model.safetensors`.
    `entries()` reads the headers only; `load()` reads the tensors one at a time."""

    def __init__(self, path: object, adapter: bool) -> None:
        if not isinstance(path, str) or not path:
            raise WeightProblem(f"model_path: must be a directory, got {path!r}")
        self.path = Path(path)
        if not self.path.is_dir():
            raise WeightProblem(f"model_path: {path} is not a directory")
        try:
            self.files = [self.path / ADAPTER_WEIGHTS] if adapter else weight_files(self.path)
        except (CheckpointError, FileNotFoundError) as err:
            raise WeightProblem(f"model_path: {err}") from None
        self.where: dict[str, Path] = {}

    def entries(self) -> list[Entry]:
        out = []
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                        part = f.get_slice(key)
                        dtype = SAFETENSORS_DTYPES.get(part.get_dtype(), part.get_dtype())
                        out.append(Entry(key, tuple(part.get_shape()), dtype))
                        self.where[key] = file
            except (SafetensorError, OSError) as err:
                raise WeightProblem(f"model_path: {file}: not a safetensors file ({err})") from None
        if not out:
            raise WeightProblem(f"model_path: {self.path} holds no tensors")
        return out

    def load(self, targets: Targets, entries: Sequence[Entry]) -> None:
        """Each tensor read, copied into its target and dropped before the next."""
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for e in entries:
                    if self.where[e.name] == file:
                        tensor = f.get_tensor(e.name)
                        targets.write(e.name, tensor)
                        del tensor
        targets.finish()
