"""`WeightSender` pushing to two `python -m astrai.serve` replicas over a gloo group.

Independent reference: after a push of weights W at version v, a replica's `/generate`
equals an in-process engine on a model holding W (same seed, greedy and sampled). A push
one replica refuses changes neither (the handshake), and one replica killed (SIGKILL) in the
middle of a push leaves the push to succeed over the other. The tests share the two replicas and run
in order (the last one kills a replica)."""

from __future__ import annotations

import signal

import pytest
import torch
from remote_helpers import LORA_RANK, adapter_model, make_adapter_dir, start_replica
from server_process import stop

from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import AutoModel, save_lora, save_pretrained
from astrai.model.lora import lora_state_dict
from astrai.remote import ReplicaClient, ReplicaError, WeightSender
from astrai.remote.weight_group import WeightGroup

pytestmark = pytest.mark.slow  # two server subprocesses

PROMPT = [12, 40, 7, 3, 99]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=6, n=3, logprobs_mode="scaled")


def perturbed(model_dir, seed: int) -> torch.nn.Module:
    model = AutoModel.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def reference(model, tokenizer, adapter_dir=None) -> InferenceEngine:
    """An engine built as the replicas' (`engine=contiguous`, LoRA on: `lora_modules`)."""
    engine = InferenceEngine(
        model, tokenizer, max_batch_size=8, max_seq_len=256, cache_mode="contiguous", lora={}
    )
    if adapter_dir is not None:
        engine.load_adapter("a", adapter_dir)
    return engine


def outputs(results) -> list:
    return [(r.token_ids, r.logprobs, r.finish_reason) for r in results]


def assert_serves(client: ReplicaClient, ref: InferenceEngine, version: int, adapter=None) -> None:
    for params in (GREEDY, SAMPLED):
        if adapter is not None:
            params = SamplingParams(**{**params.__dict__, "adapter": adapter})
        got = client.generate([PROMPT], params, seed=5, policy_version=version)
        want = ref.run_batch([PROMPT], params, seed=5, return_details=True)
        assert outputs(got) == outputs(want), client.url


@pytest.fixture(scope="module")
def replicas(remote_model_dir, tmp_path_factory):
    adapter = make_adapter_dir(remote_model_dir, tmp_path_factory.mktemp("adapter") / "a", 1)
    procs = []
    try:
        for _ in range(2):
            procs.append(start_replica(remote_model_dir, f"lora_modules={{a: '{adapter}'}}"))
        clients = [ReplicaClient(url, timeout=120) for _, url in procs]
        sender = WeightSender(clients, timeout=60)
        yield [p for p, _ in procs], clients, sender, adapter
        sender.close()
        # a survivor of the killed member's group stops at once, not after its timeout
        running = [p for p, _ in procs if p.poll() is None]
        assert [stop(p) for p in running] == [0] * len(running)
    finally:
        for proc, _ in procs:
            stop(proc)


@pytest.fixture(scope="module")
def weights(remote_model_dir):
    """The trainer's policy: the replicas' model moved by seeded noise."""
    return perturbed(remote_model_dir, seed=1)


def test_push_equals_an_engine_holding_the_weights(replicas, weights, remote_tokenizer, one_thread):
    _, clients, sender, _ = replicas
    seconds = sender.push(weights.named_parameters(), version=1)
    assert seconds > 0 and sender.alive == clients
    ref = reference(weights, remote_tokenizer)
    try:
        for client in clients:
            assert client.policy_version() == 1
            assert_serves(client, ref, 1)
    finally:
        ref.shutdown()


def test_a_push_one_replica_refuses_changes_none(
    replicas, weights, remote_model_dir, remote_tokenizer, tmp_path, one_thread
):
    """Replica 0 is moved to version 2 from disk; a push at version 2 is then refused by it
    (not newer), so replica 1, which would have taken it, keeps version 1 and its weights."""
    _, clients, sender, _ = replicas
    save_pretrained(weights, tmp_path / "w")
    assert clients[0].update_weights_from_disk(str(tmp_path / "w"), 2) == 2
    other = perturbed(remote_model_dir, seed=2)
    with pytest.raises(ReplicaError, match="policy_version: 2 is not greater") as refused:
        sender.push(other.named_parameters(), version=2)
    assert refused.value.status == 400
    assert [c.policy_version() for c in clients] == [2, 1]
    ref = reference(weights, remote_tokenizer)
    try:
        assert_serves(clients[0], ref, 2)
        assert_serves(clients[1], ref, 1)
        bad = [
            (n, torch.zeros(3) if n.endswith("norm.weight") else t)
            for n, t in other.named_parameters()
        ]
        with pytest.raises(
            ReplicaError, match=r"shapes: .*norm.weight has shape \[64\] in the model, got \[3\]"
        ):
            sender.push(bad, version=3)
        assert [c.policy_version() for c in clients] == [2, 1]
        assert_serves(clients[1], ref, 1)
    finally:
        ref.shutdown()
    assert sender.push(weights.named_parameters(), version=3) > 0  # the group still works
    assert [c.policy_version() for c in clients] == [3, 3]


def test_lora_push_equals_an_engine_that_loaded_the_adapter(
    replicas, weights, remote_model_dir, remote_tokenizer, tmp_path, one_thread
):
    _, clients, sender, _ = replicas
    trained = adapter_model(remote_model_dir, seed=7)  # another adapter of the same shape
    tensors = lora_state_dict(trained)
    assert all(t.shape[0] == LORA_RANK or t.shape[1] == LORA_RANK for t in tensors.values())
    sender.push(tensors.items(), version=4, lora_name="a")

    ref = reference(weights, remote_tokenizer, save_lora(trained, tmp_path / "new-a"))
    try:
        for client in clients:
            assert client.policy_version() == 4
            assert_serves(client, ref, 4, adapter="a")
            assert_serves(client, ref, 4)  # the base keeps the pushed policy
    finally:
        ref.shutdown()


def test_a_replica_killed_mid_push_leaves_the_push_to_the_survivor(
    replicas, remote_model_dir, remote_tokenizer, one_thread, monkeypatch
):
    """Replica 1 is SIGKILLed after the trainer broadcast two tensors of a push: the push
    still succeeds, over replica 0 alone, which ends up holding the whole new policy."""
    procs, clients, sender, _ = replicas
    broadcast = WeightGroup.broadcast
    sent = []

    def kill_after_two(group: WeightGroup, tensor: torch.Tensor) -> None:
        if group.rank == 0 and group.world_size == 3:
            sent.append(tensor.shape)
            if len(sent) == 3:
                procs[1].send_signal(signal.SIGKILL)
                procs[1].wait(timeout=30)
        broadcast(group, tensor)

    monkeypatch.setattr(WeightGroup, "broadcast", kill_after_two)
    newer = perturbed(remote_model_dir, seed=9)
    assert sender.push(newer.named_parameters(), version=5) > 0
    assert len(sent) >= 3 and procs[1].poll() is not None
    assert sender.alive == [clients[0]]
    ref = reference(newer, remote_tokenizer)
    try:
        assert_serves(clients[0], ref, 5)
    finally:
        ref.shutdown()
