"""Phi-3 / Phi-4 (`astrai.model.hf_phi3`): fused qkv / gate_up projections and partial rotary
(Phi-4-mini). Logit parity both ways is in test_hf_interop.py's CASES; here the export's
tensor names, the engine's greedy tokens against transformers' `generate`, a LoRA training,
LongRoPE (Phi-3-*-128k, Phi-4-mini) on both sides of its original context, and a sliding
window."""

import json

import pytest
import torch
import transformers
from hf_helpers import (
    SIZES,
    assert_engine_greedy_equals_hf,
    assert_export_round_trip,
    assert_lora_trains,
    hf_greedy,
)

from astrai.model import AutoModel, ConfigError, ModelConfig, Transformer, save_pretrained
from astrai.model.rope import PartialRotary

PARTIAL = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
ORIGINAL = 16  # LongRoPE's original context: the tests' sequences cross it
_factors = torch.Generator().manual_seed(7)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.75,  # Phi-4-mini: 6 rotary frequencies per head
    "short_factor": (1 + torch.rand(6, generator=_factors)).tolist(),
    "long_factor": (2 + 8 * torch.rand(6, generator=_factors)).tolist(),
}
CASES = {
    "phi3": {},
    "phi4-mini": dict(rope_parameters=PARTIAL, tie_word_embeddings=True),
    "phi4-mini-longrope": dict(rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL),
}


def build_hf(case: str, vocab: int = 320) -> transformers.Phi3ForCausalLM:
    config = transformers.Phi3Config(
        vocab_size=vocab, pad_token_id=1, bos_token_id=0, eos_token_id=2, **SIZES, **CASES[case]
    )
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("length", [12, 20])  # LongRoPE: short factors, then long ones
def test_phi3_export_fuses_projections_as_transformers_names_them(case, length, tmp_path):
    x = torch.randint(0, 320, (2, length), generator=torch.Generator().manual_seed(1))
    assert_export_round_trip(build_hf(case), tmp_path, x)


def test_longrope_is_read_with_its_factors_and_written_back(tmp_path):
    build_hf("phi4-mini-longrope").save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf")
    scaling = ours.config.rope_scaling
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == ORIGINAL
    assert scaling["long_factor"] == pytest.approx(LONGROPE["long_factor"])
    save_pretrained(ours, tmp_path / "out", hf_format=True)
    back = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert back.rope_parameters["rope_type"] == "longrope"
    assert back.rope_parameters["short_factor"] == pytest.approx(LONGROPE["short_factor"])
    assert back.original_max_position_embeddings == ORIGINAL


def test_longrope_factors_are_checked_naming_the_field():
    bad = dict(LONGROPE, original_max_position_embeddings=16, short_factor=[1.0] * 5)
    with pytest.raises(ConfigError, match=r"rope_scaling\.short_factor: expected 6 numbers"):
        ModelConfig(vocab_size=64, **SIZES, partial_rotary_factor=0.75, rope_scaling=bad)
    missing = {k: v for k, v in LONGROPE.items() if k != "long_factor"}
    missing["original_max_position_embeddings"] = 16
    with pytest.raises(ConfigError, match=r"rope_scaling\.long_factor: required"):
        ModelConfig(vocab_size=64, **SIZES, partial_rotary_factor=0.75, rope_scaling=missing)


def test_engine_rotates_each_token_by_its_own_position_past_the_original_context(
    tmp_path, stdlib_tokenizer
):
    """The engine picks a token's factors by its own position, transformers by a call's
    longest position: below the original context both give transformers' greedy tokens; for a
    prompt across it the engine equals full recomputation with per-token factors."""
    from astrai.inference import InferenceEngine
    from astrai.model.longrope import longrope_inv_freq

    hf = build_hf("phi4-mini-longrope", len(stdlib_tokenizer))
    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf").eval()
    short, scale = longrope_inv_freq(ours.config, long=False)
    long, _ = longrope_inv_freq(ours.config, long=True)

    def per_token_rotary(position_ids, max_position=None, *, per_token=False):
        pos = position_ids.float()[..., None]
        angles = torch.where(pos >= ORIGINAL, pos * long, pos * short)
        return angles.cos() * scale, angles.sin() * scale

    gen = torch.Generator().manual_seed(3)
    below = torch.randint(0, len(stdlib_tokenizer), (6,), generator=gen).tolist()
    across = torch.randint(0, len(stdlib_tokenizer), (20,), generator=gen).tolist()  # crosses 16
    with InferenceEngine(
        ours, stdlib_tokenizer, cache_mode="paged", page_size=4, max_seq_len=64, start=False
    ) as eng:
        kw = dict(temperature=0.0, ignore_eos=True)
        got_below = eng.run_batch([below], max_tokens=ORIGINAL - len(below), **kw)[0]
        got_across = eng.run_batch([across], max_tokens=12, **kw)[0]
    assert got_below == hf_greedy(hf, below, ORIGINAL - len(below))
    ours.rotary.forward = per_token_rotary  # the reference: full recomputation per token
    ids = list(across)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(ours(torch.tensor([ids]))[0, -1].argmax()))
    assert got_across == ids[len(across) :]


def test_partial_rotary_is_read_and_rotates_three_quarters(tmp_path):
    build_hf("phi4-mini").save_pretrained(tmp_path)
    ours = AutoModel.from_pretrained(tmp_path)
    assert ours.config.partial_rotary_factor == 0.75 and ours.config.rotary_dim() == 12
    rotate = ours.layers[0].self_attn.rotate_qk
    assert isinstance(rotate, PartialRotary)
    # The pass-through dims are untouched, whatever the angle.
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos, sin = torch.randn(5, 6), torch.randn(5, 6)
    q2, k2 = rotate(q, k, cos, sin)
    assert torch.equal(q2[..., 12:], q[..., 12:]) and torch.equal(k2[..., 12:], k[..., 12:])
    assert not torch.allclose(q2[..., :12], q[..., :12])


# LongRoPE's engine rule differs from transformers' past the original context: its own test
@pytest.mark.parametrize("case", ["phi3", "phi4-mini"])
def test_engine_greedy_equals_transformers_generate(case, tmp_path, stdlib_tokenizer):
    hf = build_hf(case, len(stdlib_tokenizer))
    assert_engine_greedy_equals_hf(hf, tmp_path, stdlib_tokenizer)


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_trains_on_phi3(case, tmp_path):
    assert_lora_trains(build_hf(case), tmp_path)


def _rewrite_config(path, **changes) -> None:
    data = json.loads((path / "config.json").read_text())
    data.update(changes)
    (path / "config.json").write_text(json.dumps(data))


def test_a_phi3_window_loads_on_every_layer(tmp_path):
    build_hf("phi3").save_pretrained(tmp_path)
    _rewrite_config(tmp_path, sliding_window=32)  # one on every layer
    assert AutoModel.from_pretrained(tmp_path).config.sliding_window == 32
    _rewrite_config(tmp_path, sliding_window=128)  # as long as the context: no window at all
    windowless = AutoModel.from_pretrained(tmp_path).config
    assert windowless.hf_model_type == "phi3" and windowless.sliding_window is None


def test_partial_rotary_without_a_phi3_equivalent_is_refused(tmp_path):
    cfg = ModelConfig(vocab_size=64, **SIZES, partial_rotary_factor=0.5, qk_norm=True)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        save_pretrained(Transformer(cfg), tmp_path, hf_format=True)
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig(vocab_size=64, **SIZES, partial_rotary_factor=0.1)  # 16 * 0.1 -> 1 (odd)
