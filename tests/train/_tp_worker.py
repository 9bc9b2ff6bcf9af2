"""Run by tests/train/test_tensor_parallel.py: 2 gloo processes split a tiny model with the
tensor-parallel plan (FSDP2 over a 1-rank data-parallel dim, as the strategy does) and score
the same tokens as an unsplit copy through the chunked and the dense heads (temperature,
entropy, label smoothing, ignored targets); rank 0 prints the largest differences as JSON.

The model is one of `MODELS`: the tiny Llama/Qwen3 block tied or untied, OLMo 2's post-norm
block with its q/k norm over the whole projection, Gemma 3's sandwich block (GeGLU, scaled
embeddings, (1 + w) norms, local layers with a window shorter than the sequence)."""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from astrai.likelihood import ChunkedHead, DenseHead
from astrai.model import Transformer
from astrai.model.config import preset
from astrai.train.tensor_parallel import apply_tensor_parallel

MODELS = {
    "tied": dict(tie_word_embeddings=True, qk_norm=True),
    "untied": dict(tie_word_embeddings=False, qk_norm=True),
    "olmo2": dict(
        tie_word_embeddings=False, norm_position="post", qk_norm=True, qk_norm_scope="projection"
    ),
    "gemma3": dict(
        norm_position="sandwich",
        norm_type="gemma",
        qk_norm=True,
        scale_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=24,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_local_base_freq=10000.0,
    ),
}


def _worker(rank: int, world: int, port: int, model_name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    ref = Transformer(preset("tiny", **MODELS[model_name]))
    with torch.no_grad():  # norms away from their identity start, so their weights matter
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("data_parallel", "tensor_parallel"))
    apply_tensor_parallel(model, mesh["tensor_parallel"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    targets = ids.roll(-1, 1)
    targets[:, -1] = -100
    targets[0, :3] = -100
    out = {}
    for name, head in (("chunked", ChunkedHead(5)), ("dense", DenseHead())):
        scores = []
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
            s = head.scores(m, ids, targets, temperature=0.7, entropy=True, label_smoothing=True)
            # the entropy's gradient too (GRPO's entropy bonus)
            (-s.logp.sum() + 0.3 * s.smooth.sum() - 0.2 * s.entropy.sum()).backward()
            scores.append(s)
        grad = scale = 0.0
        for p, q in zip(ref.parameters(), model.parameters()):
            g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
            grad = max(grad, float((p.grad - g).abs().max()))
            scale = max(scale, float(p.grad.abs().max()))
        a, b = scores
        out[name] = {
            "logp": float((a.logp - b.logp).abs().max()),
            "entropy": float((a.entropy - b.entropy).abs().max()),
            "smooth": float((a.smooth - b.smooth).abs().max()),
            "grad": grad,
            "grad_scale": scale,
            "plain": all(type(t) is torch.Tensor for t in b),
        }
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    port, model_name = int(sys.argv[1]), sys.argv[2]
    mp.spawn(_worker, args=(2, port, model_name), nprocs=2)
