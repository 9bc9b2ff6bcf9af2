"""The trainer-replica group (astrai.remote.weight_group): the handshake's all-or-nothing,
and a transfer rank 0 gives up halfway, which the replica notices at once and answers by
refusing to generate on a mix of two versions until a complete update."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from astrai.inference import InferenceEngine, SamplingParams
from astrai.model import AutoModel, save_pretrained
from astrai.remote import ReplicaClient, ReplicaUnavailable
from astrai.remote.weight_group import WeightGroup, WeightStore
from astrai.remote.weight_sender import in_background
from astrai.remote.wire import dtype_name
from astrai.serve import ServerThread, ServeSettings, create_app


def _members(world: int, name: str) -> tuple[WeightStore, list[WeightGroup]]:
    store = WeightStore("127.0.0.1", 0, timeout=30)
    others = [
        in_background(
            WeightGroup.join,
            "127.0.0.1",
            store.port,
            name=name,
            rank=r,
            world_size=world,
            timeout=30,
        )
        for r in range(1, world)
    ]
    root = WeightGroup(store.store, name=name, rank=0, world_size=world, timeout=30)
    return store, [root, *(f.result(timeout=60) for f in others)]


def test_the_handshake_is_all_or_nothing():
    _, members = _members(3, "hs")
    for says in ([True, True, True], [True, False, True]):
        answers = [in_background(m.handshake, ok) for m, ok in zip(members, says)]
        assert [a.result(timeout=60) for a in answers] == [all(says)] * 3
    sent = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    got = [torch.zeros(2, 3) for _ in members[1:]]
    waits = [in_background(m.broadcast, t) for m, t in zip(members[1:], got)]
    members[0].broadcast(sent)
    for w, t in zip(waits, got):
        w.result(timeout=60)
        assert torch.equal(t, sent)


def test_an_aborted_transfer_leaves_no_generation_on_mixed_weights(
    remote_model_dir, remote_tokenizer, tmp_path
):
    engine = InferenceEngine(
        AutoModel.from_pretrained(remote_model_dir),
        remote_tokenizer,
        max_batch_size=4,
        max_seq_len=128,
        cache_mode="contiguous",
    )
    new = AutoModel.from_pretrained(remote_model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05)
    tensors = list(new.named_parameters())[:3]
    try:
        with ServerThread(create_app(engine, ServeSettings(allow_weight_updates=True))) as srv:
            client = ReplicaClient(srv.url, timeout=60)
            store = WeightStore("127.0.0.1", 0, timeout=30)
            join = in_background(
                client.init_weights_update_group, "127.0.0.1", store.port, 1, 2, "g", "gloo"
            )
            group = WeightGroup(store.store, name="g", rank=0, world_size=2, timeout=30)
            join.result(timeout=60)
            answer = in_background(
                client.update_weights_from_distributed,
                [n for n, _ in tensors],
                [dtype_name(t.dtype) for _, t in tensors],
                [list(t.shape) for _, t in tensors],
                version=1,
                group_name="g",
            )
            assert group.handshake(True)
            first_name, first = tensors[0]
            group.broadcast(first.detach())
            target = engine.model.state_dict()[first_name]
            deadline = time.monotonic() + 60
            while not torch.equal(target, first):  # the replica has copied the first one in
                assert time.monotonic() < deadline
                time.sleep(0.01)
            group.abort()  # and gives the rest up
            with pytest.raises(ReplicaUnavailable, match="aborted by rank 0"):
                answer.result(timeout=60)
            assert engine.policy_version == 0
            body = {"input_ids": [[3, 4]], "sampling_params": {"max_tokens": 2}}
            r = httpx.post(srv.url + "/generate", json=body, timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "weights_inconsistent"
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(srv.url + "/v1/chat/completions", json=chat).status_code == 503
            # a complete update (here from disk) serves again
            save_pretrained(new, tmp_path / "new")
            assert client.update_weights_from_disk(str(tmp_path / "new"), 2) == 2
            out = client.generate([[3, 4]], SamplingParams(max_tokens=2, temperature=0), seed=0)
            assert out[0].finish_reason in ("length", "stop") and out[0].token_ids
    finally:
        engine.shutdown()
