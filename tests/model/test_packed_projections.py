"""Packed q/k/v and gate/up projections (astrai.model.packed): same outputs as the separate
products, kept in step with the training parameters, never used with gradients on."""

from __future__ import annotations

import pytest
import torch

from astrai.extension import onednn_linear_enabled
from astrai.inference import InferenceEngine
from astrai.model import preset_model
from astrai.model.layers import MLP, Attention, PackedLinear, engine_forward
from astrai.model.lora import LoRAConfig, inject_lora
from astrai.model.packed import (
    pack_projections,
    refresh_packs,
    release_projections,
)
from astrai.tokenizer import AutoTokenizer


def _model(name: str = "tiny", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return preset_model(name, **overrides).eval()


def _packs(model: torch.nn.Module) -> list[PackedLinear]:
    found = []
    for m in model.modules():
        if isinstance(m, Attention) and m.packed_qkv is not None:
            found.append(m.packed_qkv)
        if isinstance(m, MLP) and m.packed_gate_up is not None:
            found.append(m.packed_gate_up)
    return found


def _inject_live_lora(model: torch.nn.Module, config: LoRAConfig) -> None:
    """LoRA wrappers whose B is random (not zero): they change the model's outputs."""
    inject_lora(model, config)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_B"):
                m.lora_B.weight.normal_()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's no-grad forward as an engine runs it (with its packs)."""
    with torch.no_grad(), engine_forward():
        return model(ids)


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("tiny", {}),
        ("tiny", {"qk_norm": True, "attention_bias": True}),
        ("tiny-moe", {}),  # the shared expert is an MLP: packed too
        ("tiny-mla", {}),  # MLA attention is not packed; its MLPs are
    ],
)
def test_packed_outputs_match_the_separate_products(name, overrides):
    model = _model(name, **overrides)
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    expected = _logits(model, ids)
    nbytes = pack_projections(model)
    try:
        packs = _packs(model)
        assert packs and nbytes == sum(p.nbytes for p in packs)
        weights = sum(m.weight.numel() for p in packs for m in p.sources)
        biases = sum(m.bias.numel() for p in packs for m in p.sources if m.bias is not None)
        assert nbytes == (weights + biases) * 4  # fp32: one more copy of exactly these
        torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-5, atol=1e-5)
    finally:
        release_projections(model)
    assert not _packs(model)


def test_the_pack_holds_concatenated_weights_and_splits_outputs():
    model = _model(qk_norm=False, attention_bias=True)
    attn = model.layers[0].self_attn
    pack = PackedLinear((attn.q_proj, attn.k_proj, attn.v_proj))
    torch.testing.assert_close(
        pack.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    )
    x = torch.randn(5, model.config.hidden_size)
    with torch.no_grad():
        q, k, v = pack(x)
        torch.testing.assert_close(q, attn.q_proj(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, attn.v_proj(x), rtol=1e-5, atol=1e-6)
    assert [t.shape[-1] for t in (q, k, v)] == pack.sizes


def test_an_optimizer_step_refreshes_the_pack_in_place():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    pack_projections(model)
    try:
        pack = model.layers[0].self_attn.packed_qkv
        address = pack.weight.data_ptr()
        before = _logits(model, ids)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(ids).float().logsumexp(-1).mean().backward()  # training: gradients on
        opt.step()
        model.eval()
        after = _logits(model, ids)
        assert not torch.allclose(after, before)  # the step changed the model...
        assert pack.weight.data_ptr() == address  # ...and the pack followed, in place
        release_projections(model)
        torch.testing.assert_close(_logits(model, ids), after, rtol=1e-5, atol=1e-5)
    finally:
        release_projections(model)


def test_training_never_reads_the_pack():
    model = _model()
    pack_projections(model)
    try:
        ids = torch.randint(0, model.config.vocab_size, (1, 7))
        model(ids).sum().backward()
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        for p in (attn.q_proj.weight, attn.k_proj.weight, mlp.gate_proj.weight):
            assert p.grad is not None and p.grad.abs().sum() > 0
    finally:
        release_projections(model)


def test_load_state_dict_and_lora_after_packing():
    model, other = _model(), _model("tiny")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    pack_projections(model)
    try:
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(_logits(model, ids), _logits(other, ids), rtol=1e-5, atol=1e-5)
        # LoRA replaces q/k/v/o with wrappers: the pack must stop serving them.
        _inject_live_lora(model, LoRAConfig(r=2))
        with_lora = _logits(model, ids)
        assert not torch.allclose(with_lora, _logits(other, ids))
        release_projections(model)
        torch.testing.assert_close(_logits(model, ids), with_lora, rtol=1e-5, atol=1e-5)
    finally:
        release_projections(model)


def test_refresh_packs_covers_a_forward_that_runs_no_python():
    model = _model()
    pack_projections(model)
    try:
        pack = model.layers[1].mlp.packed_gate_up
        with torch.no_grad():
            model.layers[1].mlp.up_proj.weight.add_(1.0)
        refresh_packs(model)  # what a CUDA graph replay relies on
        up = model.layers[1].mlp.up_proj.weight
        torch.testing.assert_close(pack.weight[-up.shape[0] :], up)
    finally:
        release_projections(model)


def test_packed_linear_refuses_what_it_cannot_pack():
    model = _model()
    with pytest.raises(TypeError, match="plain astrai Linear"):
        PackedLinear((torch.nn.Linear(4, 4),))
    mlp = model.layers[0].mlp  # gate reads hidden, down reads intermediate
    with pytest.raises(ValueError, match="same input size"):
        PackedLinear((mlp.gate_proj, mlp.down_proj))


def _tokenizer() -> AutoTokenizer:
    from astrai.bench.common import bench_tokenizer

    return bench_tokenizer(384)


def test_building_an_engine_leaves_the_models_own_forward_bit_identical():
    """The packs and the cache-residency choice an engine puts on the model serve only the
    engine's forwards: the model's own no-grad forward (a trainer's scoring, a reference)
    computes exactly what it did before the engine was built, and while it lives."""
    model, tok = _model(), _tokenizer()
    ids = torch.randint(
        0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        before = model(ids)
    engine = InferenceEngine(model, tok, start=False)
    try:
        assert _packs(model)  # the engine did pack the model
        with torch.no_grad():
            assert torch.equal(model(ids), before)
        engine.run_batch([[5, 6, 7]], max_tokens=4, temperature=0.0)
        with torch.no_grad():
            assert torch.equal(model(ids), before)
    finally:
        engine.shutdown()


def test_engines_share_packs_and_the_last_one_drops_them():
    model, tok = _model(), _tokenizer()
    prompt = [[5, 6, 7, 8, 9]]
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, tok, packed_projections=False) as plain:
        expected = plain.generate(prompt, **kw)
        assert not _packs(model)
    first = InferenceEngine(model, tok)
    second = InferenceEngine(model, tok)
    packs = _packs(model)
    assert packs
    assert first.generate(prompt, **kw) == expected
    first.shutdown()
    assert _packs(model) == packs  # the second engine still uses them
    assert second.generate(prompt, **kw) == expected
    second.shutdown()
    assert not _packs(model)


def test_a_weight_update_between_requests_is_seen_by_graph_replays():
    """The decode-graph stand-in replays on fixed buffers: the runner refreshes the packs."""
    model, tok = _model(), _tokenizer()
    prompt = [[5, 6, 7, 8, 9]]
    kw = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, tok, decode_graphs="stand-in") as eng:
        eng.generate(prompt, **kw)

        def bump() -> None:
            with torch.no_grad():
                for layer in model.layers:
                    layer.mlp.gate_proj.weight.mul_(-2.0)
                    layer.self_attn.v_proj.weight.mul_(3.0)

        eng.update_weights(bump)
        got = eng.generate(prompt, **kw)
        assert eng.graph_runner is not None and sum(eng.graph_runner.replays.values()) > 0
    with InferenceEngine(model, tok, packed_projections=False) as fresh:
        assert got == fresh.generate(prompt, **kw)


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    from astrai.model.layers import Linear

    return [m for m in model.modules() if type(m) is Linear]


@pytest.mark.skipif(not onednn_linear_enabled(), reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-mla"])
def test_prepacked_weights_serve_every_projection(name):
    """With `rows` every Linear not in a q/k/v or gate/up pack gets a oneDNN-prepacked
    weight (o_proj, down_proj, lm_head, MLA's): the logits are the plain model's."""
    model = _model(name, vocab_size=600, hidden_size=128)
    ids = torch.randint(0, model.config.vocab_size, (3, 17))
    expected = _logits(model, ids)
    nbytes = pack_projections(model, rows=16)
    try:
        singles = [m for m in _linears(model) if m.pack is not None]
        assert model.lm_head in singles and all(m.pack.prepacked is not None for m in singles)
        assert all(p.prepacked is not None for p in _packs(model))
        assert nbytes >= sum(m.weight.numel() * 4 for m in singles)
        torch.testing.assert_close(_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    finally:
        release_projections(model)
    assert all(m.pack is None for m in _linears(model)) and not _packs(model)


@pytest.mark.skipif(not onednn_linear_enabled(), reason="this torch build has no oneDNN linear")
def test_a_prepacked_weight_follows_its_parameter_and_lora_on_top():
    model = _model("tiny", hidden_size=128, head_dim=32)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    pack_projections(model, rows=16)
    try:
        down = model.layers[0].mlp.down_proj
        before = down.pack.prepacked
        with torch.no_grad():
            down.weight.mul_(-1.5)  # an in-place update of a prepacked layer's parameter
        changed = _logits(model, ids)
        assert down.pack.prepacked is not before  # re-laid out from the new values
        _inject_live_lora(model, LoRAConfig(r=2, target_modules=["o_proj", "down_proj"]))
        with_lora = _logits(model, ids)
        assert not torch.allclose(with_lora, changed)
        release_projections(model)
        torch.testing.assert_close(_logits(model, ids), with_lora, rtol=1e-4, atol=1e-4)
    finally:
        release_projections(model)


def test_copies_and_pickles_of_a_packed_model_carry_no_pack(tmp_path):
    """An export or a frozen reference deep-copies the model while an engine has packed it."""
    import copy

    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    pack_projections(model, rows=16)
    try:
        twin = copy.deepcopy(model)
        assert _packs(model) and not _packs(twin)
        assert all(m.pack is None for m in _linears(twin))
        torch.save(model, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        assert not _packs(loaded)
        torch.testing.assert_close(_logits(twin, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)
    finally:
        release_projections(model)
