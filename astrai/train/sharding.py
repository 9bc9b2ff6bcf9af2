"""`FullyShardStrategy`: fully sharded data parallel with torch's `fully_shard` (FSDP2), on
CPU processes (gloo) as on GPUs (NCCL).

Why not Lightning's `FSDPStrategy`: it wraps the model in the first FSDP API
(`FullyShardedDataParallel`), which refuses a CPU device ("FSDP needs a non-CPU accelerator
device"), and Lightning refuses it without CUDA ("requires a GPU accelerator"). Lightning's
`ModelParallelStrategy` runs FSDP2 anywhere a process group runs, but leaves the sharding
to the LightningModule's `configure_model`. This subclass applies it itself, the way
`trainer=fsdp` wraps units: one `fully_shard` unit per `shard_modules` class (a
`DecoderBlock` by default) and one for the rest of the model (embeddings, final norm,
head), over a one-dimensional data-parallel mesh of every rank. Gradients are
reduce-scattered (averaged over ranks, as DDP does), so N ranks of batch B train exactly as
one process of batch N x B does, up to the order of the floating-point sums.
With `tensor_parallel_size=T` the mesh is (world / T) x T: the tensor-parallel plan
(`astrai.train.tensor_parallel`) splits each matrix over T neighbouring ranks first, then
FSDP2 shards over the data-parallel dimension (docs/scaling.md "Tensor parallelism").

Checkpoints are `torch.distributed.checkpoint` folders (`last.ckpt/`: one shard file per
rank, `.metadata`, and Lightning's `meta.pt` with loops, schedules and the data position),
written to a temporary folder and renamed into place, so a kill never leaves a cut-short
one. They load at any world size: each rank reads the slices of each tensor it now owns
(`torch.distributed.checkpoint` reshards), and the data sampler resumes at the saved global
sample offset (`astrai.data.ResumableSampler`). A full single-file `.ckpt` (a one-process run)
resumes here too.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from astrai.train.checkpoint import LIGHTNING_META
from astrai.train.engine_weights import shard_companions
from astrai.train.tensor_parallel import KEY as TP_KEY
from astrai.train.tensor_parallel import apply_tensor_parallel

log = logging.getLogger(__name__)

__all__ = ["FullyShardStrategy", "full_state_dict", "is_fully_sharded"]


def _resolve_class(spec: type | str) -> type:
    if isinstance(spec, type):
        return spec
    module, _, name = str(spec).rpartition(".")
    if not module:
        raise ValueError(f"trainer.strategy.shard_modules: {spec!r} is not a dotted class path")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"trainer.strategy.shard_modules: cannot import {spec!r} ({exc})"
        ) from None


class FullyShardStrategy(ModelParallelStrategy):
    """Lightning's `ModelParallelStrategy` with the FSDP2 sharding applied by the strategy:
    `trainer=fsdp2` (docs/scaling.md).

    Args:
        shard_modules: classes (or dotted paths) whose instances become one `fully_shard`
            unit each; the model's root is one more.
        reshard_after_forward: free the gathered parameters after each unit's forward
            (ZeRO-3, `FULL_SHARD`); False keeps them until backward (ZeRO-2,
            `SHARD_GRAD_OP`): more memory, one all-gather fewer per unit.
        param_dtype, reduce_dtype: FSDP2's `MixedPrecisionPolicy` (e.g. `bfloat16`,
            `float32`): compute in `param_dtype` while the sharded master weights and the
            optimizer stay fp32. None: the trainer's `precision` alone decides.
        activation_checkpointing: recompute each decoder block in backward (the model's own
            `gradient_checkpointing`).
        save_distributed_checkpoint: sharded checkpoint folders (True) or one full file
            gathered on rank 0 (False).
        process_group_backend: None picks gloo on CPU, NCCL on CUDA.
        tensor_parallel_size: ranks that split each matrix (`astrai.train.tensor_parallel`,
            Lightning's name); the data-parallel size is the world size over it. 1: none.
    """

    def __init__(
        self,
        shard_modules: Sequence[type | str] = ("astrai.model.DecoderBlock",),
        reshard_after_forward: bool = True,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        activation_checkpointing: bool = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
            raise ValueError(f"{TP_KEY}: must be an int >= 1, got {tensor_parallel_size!r}")
        if tensor_parallel_size < 1:
            raise ValueError(f"{TP_KEY}: must be an int >= 1, got {tensor_parallel_size!r}")
        kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            **kwargs,
        )
        self.shard_modules = tuple(_resolve_class(c) for c in shard_modules)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.param_dtype = _dtype(param_dtype, "param_dtype")
        self.reduce_dtype = _dtype(reduce_dtype, "reduce_dtype")
        self.activation_checkpointing = bool(activation_checkpointing)

    # ------------------------------------------------------------------ set-up
    def setup_environment(self) -> None:
        # a (world_size / tp x tp) mesh: tensor-parallel ranks are neighbours
        world, tp = self.num_nodes * self.num_processes, self._tensor_parallel_size
        if world % tp:
            raise ValueError(f"{TP_KEY}={tp}: the {world} processes are not a multiple of it")
        self._data_parallel_size = world // tp
        super().setup_environment()

    def setup(self, trainer: L.Trainer) -> None:
        self._shard(self.lightning_module)
        super().setup(trainer)

    def _shard(self, pl_module: L.LightningModule) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = getattr(pl_module, "model", None)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"trainer.strategy: {type(self).__name__} shards the LightningModule's `model` "
                f"attribute; {type(pl_module).__name__} has none"
            )
        if is_fully_sharded(model):
            return
        if self._tensor_parallel_size > 1:
            apply_tensor_parallel(model, self.device_mesh["tensor_parallel"])
        mesh = self.device_mesh["data_parallel"]
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
        }
        if self.param_dtype is not None or self.reduce_dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype
            )
        units = [m for m in model.modules() if isinstance(m, self.shard_modules)]
        if not units:
            names = ", ".join(c.__name__ for c in self.shard_modules)
            raise ValueError(
                f"trainer.strategy.shard_modules: the model has no {names}; name the class of "
                "its repeated blocks"
            )
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(model, **options)
        shard_companions(pl_module, self.shard_modules, options)  # the reference, the engine
        if self.activation_checkpointing and hasattr(model, "gradient_checkpointing"):
            model.gradient_checkpointing = True
        log.info(
            "fully_shard: %d units + the root over %d rank(s) (%s)",
            len(units),
            mesh.size(),
            "reshard after forward" if self.reshard_after_forward else "keep after forward",
        )

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write the sharded folder under a temporary name and rename it into place (rank 0,
        after every rank has written its shard), so `path` is always whole or absent."""
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(f".{path.name}.tmp")
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        self.barrier("astrai-ckpt-clean")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("astrai-ckpt-written")
        if self.global_rank == 0:
            _replace_dir(tmp, path)
        self.barrier("astrai-ckpt-renamed")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        path = Path(checkpoint_path)
        if path.is_dir() and not (path / LIGHTNING_META).is_file():
            raise ValueError(
                f"ckpt_path: {path} is a sharded checkpoint folder without Lightning's "
                f"{LIGHTNING_META} (loops, schedules, data position): not written by a "
                "Lightning run, so it cannot be resumed"
            )
        if path.is_file():  # a one-process or DDP run's single file
            return self._load_full_checkpoint(path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def _load_full_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """Lightning's loader for a full file, with the optimizer state re-keyed by the
        optimizer's own parameter order: it numbers parameters group by group, which is not
        the model's order once weight decay splits them (Lightning assumes the model's)."""
        from lightning.fabric.strategies.model_parallel import _load_raw_module_state
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        strict = self.lightning_module.strict_loading
        _load_raw_module_state(checkpoint.pop("state_dict"), self.model, strict=strict)
        names = {param: name for name, param in self.model.named_parameters()}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            order = [names[p] for group in optimizer.param_groups for p in group["params"]]
            by_name = {
                "state": {order[i]: v for i, v in state["state"].items()},
                "param_groups": [
                    {**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]
                ],
            }
            set_optimizer_state_dict(self.model, optimizer, by_name, options=options)
        return checkpoint


def _replace_dir(new: Path, path: Path) -> None:
    """Put folder `new` at `path`, removing what was there (a folder or a file)."""
    old = path.with_name(f".{path.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if path.is_dir():
        os.replace(path, old)
    elif path.exists():
        path.unlink()
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)


def _dtype(name: str | None, field: str) -> torch.dtype | None:
    if name is None:
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"trainer.strategy.{field}: {name!r} is not a torch dtype (bfloat16, ...)")
    return dtype


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether `module` (or a submodule) is already a `fully_shard` unit."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of a `fully_shard`ed module on rank 0, in CPU memory
    (empty on the other ranks). A collective: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(module, options=options)
