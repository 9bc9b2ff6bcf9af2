"""Tensor parallelism for training (`trainer.strategy.tensor_parallel_size`, docs/scaling.md):
the decoder's matrices split over the "tensor_parallel" dimension of the strategy's mesh
(Megatron's layout, written as torch DTensor plans as torchtitan's Llama plan does).

Per block (`DecoderBlock`, OLMo 2's `PostNormBlock`, Gemma 3's `SandwichBlock`): q/k/v and
gate/up are column-parallel (each rank holds `1/N` of the heads and of the intermediate
features, so attention and SwiGLU or GeGLU run on local heads and features with no
communication), o and down are row-parallel (their partial products are
all-reduced back to the replicated hidden states). Per-head q/k norms (Qwen3, Gemma 3) see
the local heads, so their weights' gradients sum the heads of every rank; OLMo 2's norms over
the whole projection all-reduce their mean of squares; every norm's weight is a DTensor
replicated over the tensor-parallel ranks (all parameters on one mesh).
The token embedding is row-parallel over the vocabulary (torch's masked lookup, then an
all-reduce); the LM head is column-parallel over the vocabulary (each rank holds `V/N` rows;
a tied head shares the embedding's vocabulary-sharded weight):
the chunked head (`strategy.logits_chunk_size`, `astrai.model.head`) reads the local rows and
reduces over the vocabulary through :class:`VocabParallel`, so no process ever holds the full
vocabulary's logits; the dense path (`logits_chunk_size: null`) gets the logits of the local
rows (`[B, S, V/N]`, a DTensor sharded on the vocabulary) and `astrai.vocab_parallel`
computes the log-softmax over the group. Sequence parallelism is not applied: norms and
residuals are computed replicated on every tensor-parallel rank.

FSDP2 then shards every parameter over the "data_parallel" dimension as without TP
(`astrai.train.sharding.FullyShardStrategy`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from astrai.model.config import ModelConfig
from astrai.model.layers import Linear, RMSNorm
from astrai.vocab import VocabShard

log = logging.getLogger(__name__)

__all__ = [
    "KEY",
    "NormParallel",
    "VocabParallel",
    "apply_tensor_parallel",
    "block_plan",
    "check_tensor_parallel",
    "copies",
    "tensor_parallel_problems",
]

#: the setting's key in the composed config
KEY = "trainer.strategy.tensor_parallel_size"
#: the layers the plan splits (and the head)
LINEARS = ("_proj", "lm_head")


# ---------------------------------------------------------------------- checks
def tensor_parallel_problems(config: ModelConfig, size: int, world_size: int = 0) -> list[str]:
    """What stops `config` from being split over `size` tensor-parallel ranks (empty: none),
    each naming its key; `world_size` (0: unknown) must be a multiple of `size`."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return [f"{KEY}={size!r}: must be an int >= 1 (1: no tensor parallelism)"]
    if size == 1:
        return []
    found = []
    if world_size and world_size % size:
        found.append(
            f"{KEY}={size}: the {world_size} processes (trainer.devices x trainer.num_nodes) "
            f"are not a multiple of it (data-parallel size = processes / {size})"
        )
    if config.attention_type != "gqa":
        found.append(
            f"{KEY}={size}: model.attention_type={config.attention_type!r} has no "
            "tensor-parallel plan (grouped-query attention only)"
        )
    if config.num_experts > 0:
        found.append(
            f"{KEY}={size}: a mixture-of-experts model (model.num_experts="
            f"{config.num_experts}) has no tensor-parallel plan"
        )
    if config.attention_sinks:
        found.append(
            f"{KEY}={size}: attention sinks (model.attention_sinks=true, GPT-OSS) have no "
            "tensor-parallel plan"
        )
    divisible = {
        "model.num_attention_heads": config.num_attention_heads,
        "model.num_key_value_heads": config.num_key_value_heads,
        "model.intermediate_size": config.intermediate_size,
        "model.vocab_size": config.vocab_size,
    }
    for key, value in divisible.items():
        if value is not None and value % size:
            found.append(f"{KEY}={size} does not divide {key}={value}")
    return found


def check_tensor_parallel(config: ModelConfig, size: int, world_size: int = 0) -> None:
    """Raise ValueError with every problem of :func:`tensor_parallel_problems`."""
    found = tensor_parallel_problems(config, size, world_size)
    if found:
        raise ValueError("; ".join(found))


# ---------------------------------------------------------------------- vocabulary
class VocabParallel(VocabShard):
    """The LM head's rows split evenly over a tensor-parallel group: this rank holds ids
    `[start, start + vocab_size / N)`; the chunked head's reductions all-reduce over the group."""

    def __init__(self, mesh: DeviceMesh, vocab_size: int) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.start = mesh.get_local_rank() * (vocab_size // mesh.size())

    def all_reduce_max(self, t: Tensor) -> Tensor:
        t = t.clone(memory_format=torch.contiguous_format)  # the caller keeps its input
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        t = t.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(t, group=self.group)
        return t

    def __deepcopy__(self, memo: dict[int, Any]) -> VocabParallel:
        # a process group is not copyable; a copied model (a frozen reference) shares the rows' layout
        return self


# ---------------------------------------------------------------------- plan
class NormParallel(ParallelStyle):
    """A norm whose weight is replicated over the tensor-parallel mesh (a DTensor, so every
    parameter lives on the same mesh: torch's gradient clipping needs that), its input read
    as `input_layout`: `Replicate()` for the hidden states, `Shard(-2)` for column-parallel
    q or k (`[..., local heads, head_dim]`): a per-head norm (Qwen3, Gemma 3) runs on the
    local heads and its weight gradient (a sum over heads) sums the heads of every rank; for a
    norm over the whole projection (OLMo 2, `qk_norm_scope="projection"`) DTensor all-reduces
    the mean of squares over the ranks, and the output keeps this rank's heads."""

    def __init__(self, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.input_layout = input_layout if input_layout is not None else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layout

        def replicate(_name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                dt = nn.Parameter(DTensor.from_local(param, mesh, [Replicate()], run_check=False))
                mod.register_parameter(name, dt)

        def prepare(_mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
            x = inputs[0]
            place = Shard(x.dim() - 2) if layout.is_shard() else layout
            return (DTensor.from_local(x, mesh, [place], run_check=False), *inputs[1:])

        def local(_mod: nn.Module, out: DTensor, _mesh: DeviceMesh) -> Tensor:
            return out.to_local()

        return distribute_module(module, device_mesh, replicate, prepare, local)


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """The plan of one block (module names relative to it): every norm of the block
    (`DecoderBlock`'s two, OLMo 2's two post-norms, Gemma 3's sandwich of four) replicated,
    the q/k norms on the local heads, the projections column- then row-parallel."""
    norms: dict[str, ParallelStyle] = {
        name: NormParallel() for name, child in block.named_children() if isinstance(child, RMSNorm)
    }
    if block.self_attn.q_norm is not None:
        heads = Shard(-2)
        norms |= {"self_attn.q_norm": NormParallel(heads), "self_attn.k_norm": NormParallel(heads)}
    return norms | {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split `model` (an `astrai.model.Transformer`) over the 1-D tensor-parallel `mesh`, in
    place: the block plan, the vocabulary-parallel embedding and head, and
    `model.vocab_shard` (module docstring). Checks the model's config first."""
    config: ModelConfig = model.config
    check_tensor_parallel(config, mesh.size())
    for name, module in model.named_modules():
        if name.endswith(LINEARS) and type(module) is not Linear:
            raise ValueError(
                f"{KEY}={mesh.size()}: {name} is a {type(module).__name__} (e.g. strategy.lora): "
                "only the model's plain linear layers have a tensor-parallel plan"
            )
    parallelize_module(
        model,
        mesh,
        {
            # (Gemma's ScaledEmbedding too: its scale multiplies the partial sums)
            "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            # Shard(0) of the weight; the dense path's logits stay sharded on the vocabulary
            # (a DTensor: astrai.vocab_parallel computes their scores)
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            "norm": NormParallel(),
        },
    )
    if config.tie_word_embeddings:  # both Shard(0) over the vocabulary: one weight again
        model.tie_weights()
    for block in model.layers:
        parallelize_module(block, mesh, block_plan(block))
    model.vocab_shard = VocabParallel(mesh, config.vocab_size)
    log.info(
        "tensor parallel: %d blocks and the vocabulary (%d rows per rank) over %d ranks",
        len(model.layers),
        config.vocab_size // mesh.size(),
        mesh.size(),
    )


def copies(grad: Tensor) -> int:
    """On how many processes of the world this gradient's local values also live (its
    replicated mesh dimensions and the world beyond its mesh): 1 for a plain tensor."""
    if not isinstance(grad, DTensor):
        return 1
    world = dist.get_world_size()
    sharded = 1
    for size, placement in zip(grad.device_mesh.shape, grad.placements):
        if not placement.is_replicate():  # Shard, and FSDP2's _StridedShard over TP's
            sharded *= size
    return world // sharded
