"""What the run's engine runs on (`astrai.train.engine_weights`): the live model under DDP,
a full copy gathered from FSDP2's shards under `trainer=fsdp2`.

In one process: the copy is the live model's config and adapters, built without a random
draw, refreshed once per policy version, and the policy engine builds on it and keeps its
version. On 2 gloo processes (`fully_shard` of a tiny model): the gathered copy equals the
unsharded model on every rank, with one gathered tensor alive at a time; the sharded
reference's forward, its move towards the policy (`sync_reference`) and its checkpoint state
(whole tensors, loadable at any number of ranks) equal the unsharded ones.
"""

from __future__ import annotations

import copy
import socket
import weakref
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from astrai.model import LoRAConfig, Transformer, inject_lora, preset
from astrai.train.engine_weights import (
    GatheredWeights,
    LiveWeights,
    full_cpu_state,
    fully_shard_units,
    gather_into,
    load_full_state,
)
from astrai.train.policy_engine import PolicyEngine
from astrai.train.strategies.grpo.reference import sync_reference


def _model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("tiny", vocab_size=128, **overrides))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_live_weights_are_the_live_model() -> None:
    live = _model()
    weights = LiveWeights()
    assert weights.engine_model(live) is live
    weights.refresh(live, 3)  # nothing to copy
    assert weights.rank0_decides(True) and not weights.rank0_decides(False)  # no collective


def test_gathered_copy_draws_no_random_number_and_follows_the_policy_versions() -> None:
    live = _model()
    weights = GatheredWeights()
    rng = torch.get_rng_state()
    model = weights.engine_model(live)
    assert torch.equal(torch.get_rng_state(), rng)  # the training RNG is left alone
    assert model is not live and weights.step is None
    assert model.lm_head.weight is model.embed_tokens.weight  # tied as the config says
    assert not any(p.requires_grad for p in model.parameters())
    weights.refresh(live, 0)
    assert _same(model, live) and weights.step == 0
    assert weights.gathered_bytes == sum(p.numel() * 4 for p in live.parameters())
    with torch.no_grad():
        live.layers[0].mlp.up_proj.weight.add_(1.0)
    weights.refresh(live, 0)  # the same version: nothing moves
    assert not _same(model, live)
    weights.refresh(live, 1)
    assert _same(model, live) and weights.step == 1
    weights.release()
    assert weights.copy is None and weights.step is None


def test_gathered_copy_carries_the_lora_adapters_and_the_mode() -> None:
    config = LoRAConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    live = inject_lora(_model(), config)
    with torch.no_grad():
        for name, p in live.named_parameters():
            if "lora_B" in name:
                p.normal_()
    weights = GatheredWeights(config)
    weights.refresh(live, 0)
    assert _same(weights.copy, live) and weights.copy.lora_config == config
    live.eval()
    weights.refresh(live, 1)
    assert not weights.copy.training  # LoRA dropout as on the live model


def test_policy_engine_builds_on_the_copy_and_keeps_the_version() -> None:
    class Engine:
        def __init__(self, model, tokenizer, *, start, **sizes):
            self.model, self.policy_version, self.max_seq_len = model, 0, 64
            self.loads = 0

        def update_weights(self, fn, version):
            fn()
            self.loads += 1
            self.policy_version = version

        def shutdown(self):
            pass

    live = _model()
    owner = PolicyEngine(lambda: (live, None), Engine)
    owner.use_weights(GatheredWeights())
    engine = owner.sync(0)
    assert engine.model is not live and _same(engine.model, live)  # filled at the build
    with torch.no_grad():
        live.norm.weight.mul_(2.0)
    assert owner.sync(2) is engine and engine.policy_version == 2 and _same(engine.model, live)
    owner.sync(2)
    assert engine.loads == 1
    with pytest.raises(RuntimeError, match="already built"):
        owner.use_weights(LiveWeights())
    owner.close()
    # a rank without an engine takes part in the refresh and keeps the gathered copy
    other = PolicyEngine(lambda: (live, None), Engine, GatheredWeights())
    other.join(5)
    assert not other.built and _same(other.weights.copy, live) and other.weights.step == 5


def test_full_state_round_trip_and_key_check() -> None:
    a, b = _model(0), _model(1)
    load_full_state(b, full_cpu_state(a))
    assert _same(a, b)
    state = full_cpu_state(a)
    state.pop("norm.weight")
    with pytest.raises(ValueError, match=r"norm\.weight"):
        load_full_state(b, state)


# ---------------------------------------------------------------------- 2 gloo processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from astrai.model import DecoderBlock

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full, other = _model(0), _model(1)
        policy, reference = copy.deepcopy(full), copy.deepcopy(other)
        for m in (policy, reference):
            fully_shard_units(m, (DecoderBlock,), mesh=mesh)
        assert isinstance(next(policy.parameters()), DTensor)

        # the engine's copy: the whole model on every rank, one gathered tensor at a time
        alive: list[weakref.ref] = []
        peak = [0]
        gather = DTensor.full_tensor

        def spy(self, *args, **kwargs):
            out = gather(self, *args, **kwargs)
            peak[0] = max(peak[0], 1 + sum(r() is not None for r in alive))
            alive.append(weakref.ref(out))
            return out

        DTensor.full_tensor = spy
        weights = GatheredWeights()
        weights.refresh(policy, 1)
        DTensor.full_tensor = gather
        assert _same(weights.copy, full), "the gathered copy differs from the model"
        assert peak[0] == 1, f"{peak[0]} gathered tensors alive at once"
        assert weights.gathered_bytes == sum(p.numel() * 4 for p in full.parameters())
        gather_into(policy, None)  # a rank without a copy runs the same gathers

        # the sharded reference: its no-grad forward, its move, its checkpoint state
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            torch.testing.assert_close(reference(ids), other(ids), rtol=0, atol=1e-6)
        sync_reference(reference, policy, alpha=0.25)
        sync_reference(other, full, alpha=0.25)
        # a policy laid out otherwise (tensor parallelism): gathered, then sharded as the
        # reference (here a plain policy moves a sharded reference)
        twin, plain = copy.deepcopy(other), _model(3)
        fully_shard_units(twin, (DecoderBlock,), mesh=mesh)
        load_full_state(twin, {k: v.clone() for k, v in other.state_dict().items()})
        sync_reference(twin, plain, alpha=0.5)
        sync_reference(other_twin := copy.deepcopy(other), plain, alpha=0.5)
        moved = full_cpu_state(twin)
        for key, value in moved.items():
            torch.testing.assert_close(value, other_twin.state_dict()[key], rtol=0, atol=1e-7)
        state = full_cpu_state(reference)  # kept whole on rank 0 (the one that writes)
        assert state.keys() == (other.state_dict().keys() if rank == 0 else set())
        for key, value in state.items():
            torch.testing.assert_close(value, other.state_dict()[key], rtol=0, atol=1e-7)
        # every rank reads the written state (meta.pt) back into its shards
        written = [state]
        dist.broadcast_object_list(written, src=0)
        fresh = copy.deepcopy(_model(2))
        fully_shard_units(fresh, (DecoderBlock,), mesh=mesh)
        load_full_state(fresh, written[0])
        if rank == 0:
            assert _same_full(fresh, state)
        else:
            full_cpu_state(fresh)  # rank 0's gathers need this rank
        Path(out, f"ok{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


def _same_full(module: torch.nn.Module, state: dict) -> bool:
    return all(torch.equal(v, state[k]) for k, v in full_cpu_state(module).items())


@pytest.mark.slow
def test_two_ranks_gather_the_whole_model_and_shard_the_reference(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok0", "ok1"]
