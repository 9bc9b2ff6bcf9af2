"""FLOPs of an engine step and the matmul roofline (astrai/bench/roofline.py): the formula
against torch's FLOP counter on dense forwards and against a plain-torch attention, the
roofline's GEMMs against the model's own layers, and the figures `bench engine` reports."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from astrai.bench import engine_steps
from astrai.bench.common import bench_tokenizer
from astrai.bench.engine_steps import format_steps, run_steps
from astrai.bench.roofline import (
    attention_macs_per_key,
    gemm_roofline,
    peak_gflops,
    step_flops,
    step_gemms,
    visible_keys,
)
from astrai.inference import InferenceEngine
from astrai.model import preset, preset_model
from astrai.model.layers import Attention, Linear, mark_cache_resident

MM = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten._grouped_mm}


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """torch's counter has no formula for `aten._grouped_mm` (the MoE's sorted path): a 2-D
    `[rows, k]` by a 3-D `[experts, k, n]` split at row offsets is `2 * rows * k * n`."""
    rows, k = a_shape
    return 2 * rows * k * b_shape[-1]


COUNTED = {torch.ops.aten._grouped_mm: _grouped_mm_flops}

CONFIGS = {  # case: (preset, overrides)
    "tiny": ("tiny", {}),  # dense GQA (4 heads, 2 kv heads), tied head
    "tiny-untied-qknorm-bias": (
        "tiny", dict(tie_word_embeddings=False, qk_norm=True, attention_bias=True)
    ),
    "tiny-mha-head-dim": ("tiny", dict(num_key_value_heads=4, head_dim=24, o_proj_bias=True)),
    "tiny-moe": ("tiny-moe", {}),  # 4 experts (2 per token), a gated shared expert, dense layer 0
    "tiny-moe-deepseek": ("tiny-moe", dict(
        shared_expert_gate=False, num_shared_experts=2, mlp_only_layers=[], n_group=2,
        topk_group=1, router_topk_method="group_limited_greedy", router_scoring="sigmoid",
    )),
    "tiny-mla": ("tiny-mla", {}),  # q compressed (q_lora_rank 32)
    "tiny-mla-no-q-lora": ("tiny-mla", dict(q_lora_rank=None)),
}  # fmt: skip


def _model(case: str) -> torch.nn.Module:
    name, overrides = CONFIGS[case]
    torch.manual_seed(0)
    return preset_model(name, device="cpu", **overrides).eval()


@pytest.mark.parametrize("case", sorted(CONFIGS))
@pytest.mark.parametrize("shape", [(2, 12), (1, 5)])  # MoE: 48 pairs sorted, 10 gathered
def test_matmul_flops_match_torchs_counter_on_a_dense_forward(case, shape):
    """Gradients on: every Linear takes F.linear, which the counter sees (oneDNN it does not)."""
    model = _model(case)
    b, s = shape
    ids = torch.randint(0, model.config.vocab_size, shape)
    with FlopCounterMode(display=False, custom_mapping=COUNTED) as counter:
        model(ids)  # logits of every token: all b * s rows go through the lm_head
    counts = counter.get_flop_counts()["Global"]
    ours = step_flops(model.config, [s] * b, [s] * b, b * s)
    if model.config.attention_type == "mla":
        # training decompresses the latent (kv_b_proj is one mm, as the absorbed products
        # are per token); its attention is SDPA's math path in bmm, not the latent attention
        assert counts[torch.ops.aten.mm] == ours["matmul"]
    else:  # SDPA's fused CPU kernel is not counted; MoE experts: bmm or _grouped_mm
        assert sum(counts.get(op, 0) for op in MM) == ours["matmul"]
    assert ours["total"] == ours["matmul"] + ours["attention"]


def test_the_roofline_gemms_are_the_steps_matmuls():
    for case in sorted(CONFIGS):
        model = _model(case)
        for rows, sampled in ((1, 1), (5, 3), (40, 2)):
            gemms = step_gemms(model, rows, sampled)
            expected = step_flops(model.config, [1] * rows, [7] * rows, sampled)["matmul"]
            assert sum(g.flops for g in gemms) == expected, (case, rows)


def _plain_attention(q, k, v, kv_len):
    """Each query of `q [L, H, D]` against the keys it sees of `k [S, Hkv, D]` (`S = kv_len`;
    the new tokens are the last L), one matmul for its scores and one for its values."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1)
    v = v.transpose(0, 1)
    out = []
    for i in range(q.shape[0]):
        seen = kv_len - q.shape[0] + i + 1
        scores = torch.matmul(q[i][:, None, :], k[:, :seen].transpose(1, 2))  # [H, 1, seen]
        out.append(torch.matmul(scores.softmax(-1), v[:, :seen])[:, 0])
    assert out[0].shape[0] == heads
    return torch.stack(out)


@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1, 1], [5, 17, 9]), ([7], [7]), ([4, 1], [10, 3])])
def test_attention_flops_match_a_plain_torch_attention(q_lens, kv_lens):
    """Decode (one query per request), a prefill (the causal triangle), an extend; GQA."""
    config = preset("tiny")
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    counted = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        q = torch.randn(q_len, heads, d)
        k, v = torch.randn(kv_len, kv_heads, d), torch.randn(kv_len, kv_heads, d)
        with FlopCounterMode(display=False, custom_mapping=COUNTED) as counter:
            out = _plain_attention(q, k, v, kv_len)
        counted += counter.get_total_flops()
        # it is attention: causal SDPA over the same keys (the new tokens last)
        seen = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        ref = F.scaled_dot_product_attention(
            *(t.transpose(0, 1) for t in (q, k, v)), attn_mask=seen, scale=1.0, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(out, ref)
    attention = step_flops(config, q_lens, kv_lens, 0)["attention"]
    assert attention == counted * config.num_hidden_layers


def test_attention_flops_by_hand():
    config = preset("tiny")  # 4 heads of 16, 2 layers
    # decode at 10 keys: 2 FLOPs x (scores + values) x 4 heads x 16 x 10 keys x 2 layers
    assert step_flops(config, [1], [10], 1)["attention"] == 2 * 2 * 4 * 16 * 10 * 2
    # a 6-token prefill sees 1 + 2 + ... + 6 = 21 keys; after 4 cached tokens, 6 x 4 more
    assert visible_keys(6, 6) == 21 and visible_keys(6, 10) == 45
    assert step_flops(config, [6], [10], 1)["attention"] == 2 * 2 * 4 * 16 * 45 * 2
    # MLA attends in the latent space: scores over latent + rotary key, values the latent
    mla = preset("tiny-mla")  # 4 heads, kv_lora_rank 32, rope 8
    assert attention_macs_per_key(mla) == 4 * (32 + 8) + 4 * 32
    q, lat = torch.randn(3, 4, 40), torch.randn(9, 1, 40)
    with FlopCounterMode(display=False, custom_mapping=COUNTED) as counter:
        _plain_attention(q, lat, lat[..., :32], 9)
    layers = mla.num_hidden_layers
    assert step_flops(mla, [3], [9], 1)["attention"] == counter.get_total_flops() * layers
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        step_flops(config, [5], [4], 1)
    with pytest.raises(ValueError, match="sampled_rows"):
        step_flops(config, [1, 1], [3, 3], 3)


def test_gemm_roofline_times_the_models_own_shapes_and_weights():
    model = _model("tiny")
    mark_cache_resident(model)  # tiny fits any cache: products small enough stay on F.linear
    params = {p.data_ptr() for p in model.parameters()}
    out = gemm_roofline(model, 6, 2, repeats=2, min_seconds=0.0)
    h, v = model.config.hidden_size, model.config.vocab_size
    layers = {(6, m.in_features, m.out_features) for m in model.modules() if isinstance(m, Linear)}
    assert set(out["shapes"]) == (layers - {(6, h, v)}) | {(2, h, v)}  # the head at 2 rows
    assert out["flops"] == step_flops(model.config, [1] * 6, [9] * 6, 2)["matmul"]
    assert out["gemms"] == 7 * model.config.num_hidden_layers + 1
    for key in ("flops", "seconds", "gflops"):
        assert math.isfinite(out[key]) and out[key] > 0
    assert out["gflops"] == pytest.approx(out["flops"] / out["seconds"] / 1e9)
    for g in step_gemms(model, 6, 2):  # through each Linear's own route and weights
        assert isinstance(g.run.func, Linear) and g.run.func.weight.data_ptr() in params
        assert g.run.func.cache_resident
    moe = gemm_roofline(_model("tiny-moe"), 3, 3, repeats=1, min_seconds=0.0)
    # 3 tokens x 2 experts: 6 pairs over the 4 experts as 2, 2, 1, 1 rows
    assert {s for s in moe["shapes"] if s[1:] == (64, 96)} == {(2, 64, 96), (1, 64, 96)}
    assert moe["gflops"] > 0 and gemm_roofline(_model("tiny-mla"), 2, repeats=1)["gflops"] > 0
    assert 0 < peak_gflops("cpu", size=128, repeats=1) < math.inf
    with pytest.raises(ValueError, match="rows"):
        step_gemms(model, 0)


def test_run_steps_reports_the_flop_rates_and_format_steps_shows_them(monkeypatch):
    model = _model("tiny")
    tokenizer = bench_tokenizer(model.config.vocab_size)
    calls = []

    def recording(model, rows, sampled_rows=None, **kw):  # which GEMMs, the engine open
        calls.append((rows, sampled_rows, {g.name.split(".")[-1] for g in step_gemms(model, rows)}))
        return gemm_roofline(model, rows, sampled_rows, **kw)

    monkeypatch.setattr(engine_steps, "gemm_roofline", recording)
    cfg = {"step_batches": [1, 3], "step_count": 4, "repeats": 1, "seed": 0}
    report = run_steps(cfg, InferenceEngine, model, tokenizer, decode_graphs=False)
    # per batch size: the decode step's GEMMs, then the prefill plan's (all prompts, one step)
    assert [c[:2] for c in calls] == [(1, 1), (32, 1), (3, 3), (96, 3)]
    if "packed_qkv" in vars(Attention):  # the engine packs q/k/v: so does the roofline
        assert all("packed_qkv" in names and "q_proj" not in names for *_, names in calls)
    assert report["peak_gflops"] > 0
    for entry in report["batches"]:
        b = entry["batch"]
        for key in ("roofline_fraction", "prefill_roofline_fraction"):
            assert 0 < entry[key] < math.inf
        assert entry["roofline_fraction"] == pytest.approx(
            entry["gflops"] / entry["matmul_gflops_roofline"]
        )
        assert entry["prefill_roofline_fraction"] == pytest.approx(
            entry["prefill_gflops"] / entry["prefill_matmul_gflops_roofline"]
        )
        assert entry["gflops"] == pytest.approx(entry["step_gflop"] / entry["step_ms"] * 1e3)
        assert entry["prefill_tokens"] == b * report["prompt_len"]
        assert entry["peak_gflops"] == report["peak_gflops"]
        # the timed steps' FLOPs at their context: 32 prompt tokens, 3 warm-up steps, then
        # the j-th timed step writes the (32 + 3 + j)-th token of every request
        kv = [35 + j for j in (1, 2, 3, 4)]
        per_step = [step_flops(model.config, [1] * b, [n] * b, b)["total"] for n in kv]
        assert entry["step_gflop"] == pytest.approx(sum(per_step) / 4 / 1e9)
    lines = format_steps([("tiny", report)])
    assert (
        "| model | batch | decode GFLOP/s | roofline GFLOP/s | % roofline | prefill tokens "
        "| prefill GFLOP/s | prefill roofline GFLOP/s | prefill % roofline | peak GFLOP/s |"
    ) in lines
    e = report["batches"][1]
    assert lines[-1] == (
        f"| tiny | 3 | {e['gflops']:.1f} | {e['matmul_gflops_roofline']:.1f} "
        f"| {e['roofline_fraction']:.0%} | 96 | {e['prefill_gflops']:.1f} "
        f"| {e['prefill_matmul_gflops_roofline']:.1f} | {e['prefill_roofline_fraction']:.0%} "
        f"| {e['peak_gflops']:.1f} |"
    )


@pytest.mark.parametrize("case", ["tiny", "tiny-moe"])
def test_the_roofline_follows_the_engines_packed_projections(case):
    packed = pytest.importorskip("astrai.model.packed")
    model = _model(case)
    c = model.config
    loose = {g.shape for g in step_gemms(model, 4)}
    packed.pack_projections(model)
    try:
        gemms = step_gemms(model, 4)
    finally:
        packed.release_projections(model)
    shapes = {g.shape for g in gemms}
    qkv = (4, c.hidden_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim)
    assert qkv in shapes and (4, c.hidden_size, 2 * c.intermediate_size) in shapes
    assert (4, c.hidden_size, c.num_key_value_heads * c.head_dim) not in shapes  # k, v alone
    assert sum(g.flops for g in gemms) == step_flops(c, [1] * 4, [5] * 4, 4)["matmul"]
    assert sum(".packed_qkv" in g.name for g in gemms) == c.num_hidden_layers
    assert {g.shape for g in step_gemms(model, 4)} == loose  # released: one by one again
