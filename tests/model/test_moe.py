"""Mixture-of-experts MLP: routing against transformers' DeepSeek routers, dispatch against a
per-token plain-torch loop, the load-balancing loss against a hand computation, statistics,
config validation and which layers are sparse."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from astrai.model import ConfigError, ModelConfig, Transformer, preset
from astrai.model import moe as moe_module
from astrai.model.moe import MoE, Router

BASE = dict(
    vocab_size=64,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=6,
)


def reference_moe(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop in plain torch: sum_j w_j * SwiGLU_{e_j}(x) (+ gated shared expert)."""
    _, weights, ids = block.gate(x)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for j, e in enumerate(ids[t].tolist()):  # weights stay tensors: router gradients
            gu = block.experts.gate_up_proj[e] @ x[t]
            g, u = gu.chunk(2)
            acc = acc + weights[t, j] * (block.experts.down_proj[e] @ (F.silu(g) * u))
        rows.append(acc)
    out = torch.stack(rows)
    if block.shared_expert is not None:
        s = block.shared_expert(x)
        if block.shared_expert_gate is not None:
            s = torch.sigmoid(block.shared_expert_gate(x)) * s
        out = out + s
    return out


@pytest.mark.parametrize("pairs_limit", [0, 10_000])  # sort-by-expert, per-pair gather
@pytest.mark.parametrize("shared", [False, True])
def test_dispatch_equals_a_per_token_loop(monkeypatch, pairs_limit, shared):
    monkeypatch.setattr(moe_module, "GATHER_MAX_PAIRS", pairs_limit)
    cfg = ModelConfig(
        **BASE, num_shared_experts=int(shared), shared_expert_gate=shared, norm_topk_prob=True
    )
    torch.manual_seed(0)
    block = MoE(cfg, 0)
    block.reset_parameters(0.5)
    for p in block.parameters():
        if p.dim() == 2 and p.shape[0] != cfg.num_experts:
            torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(37, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(block(x), reference_moe(block, x), atol=1e-5, rtol=0)
        # any leading shape: dense [B, S, H] gives the same rows as packed [T, H]
        torch.testing.assert_close(block(x[:36].view(4, 9, -1)).view(36, -1), block(x[:36]))


def test_load_balancing_loss_equals_a_hand_computation():
    """Gate weights put token t's logits in column t, so routing is known in advance."""
    cfg = ModelConfig(**BASE)
    block = MoE(cfg, 3).train()
    logits = [
        [3.0, 1.0, 0.0, -1.0],  # experts 0, 1
        [0.0, 2.0, 1.5, -2.0],  # 1, 2
        [2.5, -1.0, 0.5, 1.0],  # 0, 3
        [-1.0, 0.0, 1.0, 3.0],  # 3, 2
        [1.0, 4.0, -1.0, 0.5],  # 1, 0
    ]
    chosen = [{0, 1}, {1, 2}, {0, 3}, {2, 3}, {0, 1}]
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, :5] = torch.tensor(logits).T
    x = torch.eye(8)[:5]
    block(x)
    stats = block.stats
    assert stats.layer_id == 3
    counts = [sum(e in c for c in chosen) for e in range(4)]
    assert stats.expert_counts.tolist() == counts == [3, 3, 2, 2]
    assert int(stats.expert_counts.sum()) == 5 * cfg.num_experts_per_tok
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    frac = [c / 10 for c in counts]
    mean_p = [sum(p[e] for p in probs) / 5 for e in range(4)]
    aux = 4 * sum(f * p for f, p in zip(frac, mean_p))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 5
    assert stats.aux_loss.item() == pytest.approx(aux, rel=1e-6)
    assert stats.z_loss.item() == pytest.approx(z, rel=1e-6)
    cv = torch.tensor(counts, dtype=torch.float)
    assert stats.load_cv().item() == pytest.approx((cv.std(unbiased=False) / cv.mean()).item())
    assert stats.aux_loss.requires_grad and stats.z_loss.requires_grad


def test_model_stats_cover_every_sparse_layer_and_sum_to_routed_tokens():
    torch.manual_seed(0)
    model = Transformer(preset("tiny-moe", num_hidden_layers=3)).train()
    ids = torch.randint(0, 512, (3, 11))
    model(ids).sum().backward()
    stats = model.router_stats()
    assert [s.layer_id for s in stats] == [1, 2]  # layer 0 is in mlp_only_layers
    for s in stats:
        assert int(s.expert_counts.sum()) == 33 * model.config.num_experts_per_tok
    aux, z = model.moe_aux_loss()
    assert aux.item() == pytest.approx(sum(s.aux_loss.item() for s in stats) / 2)
    assert z.item() == pytest.approx(sum(s.z_loss.item() for s in stats) / 2)
    assert model.layers[1].mlp.gate.weight.grad is not None
    model.eval()
    with torch.no_grad():
        model(ids[:, :4])
    assert [s.expert_counts.sum().item() for s in model.router_stats()] == [66, 66]  # unchanged


def test_a_model_with_stats_can_be_copied():
    """Exports deep-copy the live model (LoRA merge), references copy the policy."""
    model = Transformer(preset("tiny-moe")).train()
    model(torch.randint(0, 512, (1, 5))).sum().backward()
    assert model.router_stats()
    twin = copy.deepcopy(model)
    assert twin.router_stats() == [] and model.router_stats()
    assert torch.equal(twin.layers[1].mlp.gate.weight, model.layers[1].mlp.gate.weight)


def test_gradient_checkpointing_keeps_stats_and_gradients():
    torch.manual_seed(0)
    model = Transformer(preset("tiny-moe")).train()
    ids = torch.randint(0, 512, (2, 9))
    model(ids).sum().backward()
    aux_plain = model.moe_aux_loss()[0].item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing = True
    loss = model(ids).sum()
    aux = model.moe_aux_loss()[0]
    (loss + 0 * aux).backward()
    assert aux.item() == pytest.approx(aux_plain)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4)


def _deepseek_router(version: int, cfg: ModelConfig):
    if version == 2:
        hf_cfg = transformers.DeepseekV2Config(
            hidden_size=cfg.hidden_size,
            num_attention_heads=2,
            n_routed_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            topk_method=cfg.router_topk_method,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor,
        )
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        return DeepseekV2TopkRouter(hf_cfg)
    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=cfg.hidden_size,
        num_attention_heads=2,
        n_routed_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=cfg.norm_topk_prob,
    )
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return DeepseekV3TopkRouter(hf_cfg)


@pytest.mark.parametrize(
    "version, fields",
    [
        (2, dict(router_topk_method="greedy", routed_scaling_factor=16.0)),
        (2, dict(router_topk_method="group_limited_greedy", n_group=4, topk_group=2)),
        (
            3,
            dict(
                router_scoring="sigmoid",
                router_topk_method="noaux_tc",
                n_group=4,
                topk_group=2,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
                router_correction_bias=True,
            ),
        ),
    ],
)
def test_router_equals_transformers_deepseek_routers(version, fields):
    cfg = ModelConfig(**{**BASE, "num_experts": 16, "num_experts_per_tok": 3, **fields})
    torch.manual_seed(0)
    ours = Router(cfg)
    ours.reset_parameters(1.0)
    theirs = _deepseek_router(version, cfg)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        if cfg.router_correction_bias:
            ours.e_score_correction_bias.normal_(0, 0.3)
            theirs.e_score_correction_bias.copy_(ours.e_score_correction_bias)
    x = torch.randn(50, cfg.hidden_size)
    logits, weights, ids = ours(x)
    ref_logits, ref_weights, ref_ids = theirs(x)
    torch.testing.assert_close(logits, ref_logits)
    order, ref_order = ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(
        weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices)
    )


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(num_experts=-1), "num_experts"),
        (dict(router_scoring="relu"), "router_scoring"),
        (dict(router_topk_method="beam"), "router_topk_method"),
        (dict(n_group=3), "n_group"),
        (dict(router_topk_method="group_limited_greedy", n_group=2, topk_group=3), "topk_group"),
        (dict(router_topk_method="noaux_tc", n_group=4, topk_group=4), "n_group"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(mlp_only_layers=[2]), "mlp_only_layers"),
        (dict(decoder_sparse_step=0), "decoder_sparse_step"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size"),
        (dict(shared_expert_gate=True), "shared_expert_gate"),
        (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef"),
        (dict(mlp_only_layers=["0"]), "mlp_only_layers"),
    ],
)
def test_bad_moe_config_is_refused_naming_the_field(fields, field):
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{field}:"):
        ModelConfig(**{**BASE, **fields})


def test_sparse_layers_follow_qwen_and_deepseek_rules():
    def sparse(**kw):
        cfg = ModelConfig(**{**BASE, "num_hidden_layers": 6, **kw})
        return [cfg.is_moe_layer(i) for i in range(6)]

    assert sparse() == [True] * 6
    assert sparse(num_experts=0) == [False] * 6
    assert sparse(decoder_sparse_step=2) == [False, True] * 3
    assert sparse(mlp_only_layers=[0, 4]) == [False, True, True, True, False, True]
    assert sparse(first_k_dense_replace=2) == [False, False, True, True, True, True]
    listed = ModelConfig(**{**BASE, "mlp_only_layers": (1,)})  # tuples, Hydra's ListConfig
    assert listed.mlp_only_layers == [1] and listed.to_dict()["mlp_only_layers"] == [1]
    model = Transformer(ModelConfig(**{**BASE, "first_k_dense_replace": 1}))
    assert [type(b.mlp).__name__ for b in model.layers] == ["MLP", "MoE"]


def test_init_covers_the_new_parameters():
    cfg = preset("tiny-moe", router_correction_bias=True, initializer_range=0.1)
    model = Transformer(cfg)
    block = model.layers[1].mlp
    for p in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
        assert 0.08 < p.std().item() < 0.12
    assert torch.equal(block.gate.e_score_correction_bias, torch.zeros(4))
    assert "layers.1.mlp.gate.e_score_correction_bias" in model.state_dict()


def _no_host_reads(monkeypatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync in the MoE layer")

    for name in ("item", "tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.parametrize("tokens", [37, 3])  # 3 tokens x 2 slots: some experts get none
def test_grouped_dispatch_has_no_host_sync_and_equals_the_loop_forward_and_backward(
    monkeypatch, tokens
):
    monkeypatch.setattr(moe_module, "GATHER_MAX_PAIRS", 0)  # the grouped (sorted) path
    cfg = ModelConfig(**{**BASE, "moe_intermediate_size": 8}, norm_topk_prob=True)
    torch.manual_seed(0)
    block = MoE(cfg, 0).train()
    block.reset_parameters(0.5)
    assert block.experts._aligned(torch.zeros(1))
    x = torch.randn(tokens, cfg.hidden_size, requires_grad=True)
    grad = torch.randn(tokens, cfg.hidden_size)
    ref = reference_moe(block, x)
    ref_grads = torch.autograd.grad((ref * grad).sum(), [x, *block.parameters()])
    with monkeypatch.context() as m:
        _no_host_reads(m)
        out = block(x)
        grads = torch.autograd.grad((out * grad).sum(), [x, *block.parameters()])
        aux = block.stats.aux_loss  # statistics (bincount-free) are sync-free too
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    counts = torch.bincount(block.gate(x)[2].reshape(-1), minlength=cfg.num_experts)
    assert block.stats.expert_counts.tolist() == counts.tolist()
    assert aux.requires_grad


GPT_OSS_LIMIT = 0.6  # small: the products of normal(0, 0.5) weights cross it both ways


def gpt_oss_pair(hidden: int = 16, expert: int = 8):
    """transformers' GPT-OSS MLP (random weights and biases) and our MoE holding the same."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from astrai.model.hf_gpt_oss import gate_up_from_hf

    hf_cfg = transformers.GptOssConfig(
        vocab_size=32,
        hidden_size=hidden,
        intermediate_size=expert,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=GPT_OSS_LIMIT,
    )
    torch.manual_seed(0)
    hf = GptOssMLP(hf_cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.5)
    cfg = ModelConfig(
        **{**BASE, "hidden_size": hidden, "moe_intermediate_size": expert},
        norm_topk_prob=True,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=GPT_OSS_LIMIT,
    )
    block = MoE(cfg, 0)
    e = hf.experts
    gate_up, gate_up_bias = gate_up_from_hf(e.gate_up_proj.data, e.gate_up_proj_bias.data)
    block.load_state_dict(
        {
            "gate.weight": hf.router.weight.data,
            "gate.bias": hf.router.bias.data,
            "experts.gate_up_proj": gate_up,
            "experts.gate_up_proj_bias": gate_up_bias,
            "experts.down_proj": e.down_proj.data.transpose(1, 2),
            "experts.down_proj_bias": e.down_proj_bias.data,
        }
    )
    return hf, block


@pytest.mark.parametrize("path", ["gathered", "grouped", "sorted"])
def test_gpt_oss_experts_equal_transformers_on_every_dispatch_path(monkeypatch, path):
    """Router bias, expert biases, interleaved gate/up and the clamped SwiGLU (clamp hit)."""
    from astrai.extension import batch_invariant

    hf, block = gpt_oss_pair()
    monkeypatch.setattr(moe_module, "GATHER_MAX_PAIRS", 10_000 if path == "gathered" else 0)
    assert block.experts._aligned(torch.zeros(1))
    x = torch.randn(37, 16)
    with torch.no_grad():
        expected = hf(x[None])[0][0]
        if path == "sorted":
            with batch_invariant():
                got = block(x)
        else:
            got = block(x)
        e = block.experts
        gate, up = (torch.einsum("eih,th->tei", e.gate_up_proj, x) + e.gate_up_proj_bias).chunk(
            2, -1
        )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (gate > GPT_OSS_LIMIT).any() and (up < -GPT_OSS_LIMIT).any()  # the clamps bite


def test_gpt_oss_experts_backward_equals_transformers():
    hf, block = gpt_oss_pair()
    x = torch.randn(9, 16)
    grad = torch.randn(9, 16)
    (hf(x[None])[0][0] * grad).sum().backward()
    (block(x) * grad).sum().backward()
    torch.testing.assert_close(block.gate.bias.grad, hf.router.bias.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        block.experts.down_proj_bias.grad, hf.experts.down_proj_bias.grad, atol=1e-5, rtol=0
    )
