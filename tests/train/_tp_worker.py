"""Run by tests/train/test_tensor_parallel.py: 2 gloo processes split a tiny model with the
tensor-parallel plan (FSDP2 over a 1-rank data-parallel dim, as the strategy does) and score
the same tokens as an unsplit copy through the chunked and the dense heads (temperature,
entropy, label smoothing, ignored targets); rank 0 prints the largest differences as JSON."""

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


def _worker(rank: int, world: int, port: int, tied: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    ref = Transformer(preset("tiny", tie_word_embeddings=tied, qk_norm=True))
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
        grad = 0.0
        for p, q in zip(ref.parameters(), model.parameters()):
            g = q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
            grad = max(grad, float((p.grad - g).abs().max()))
        a, b = scores
        out[name] = {
            "logp": float((a.logp - b.logp).abs().max()),
            "entropy": float((a.entropy - b.entropy).abs().max()),
            "smooth": float((a.smooth - b.smooth).abs().max()),
            "grad": grad,
            "plain": all(type(t) is torch.Tensor for t in b),
        }
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    port, tied = int(sys.argv[1]), sys.argv[2] == "tied"
    mp.spawn(_worker, args=(2, port, tied), nprocs=2)
