"""`bench train` on a tiny model: the report's fields, equal work on both sides (the same
tokens and the same loss trajectory as a hand-written loop), the FLOPs formula against
the model's own matmuls, and `model.compile` (works here, or fails naming the option)."""

import json
import math

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from astrai.bench import train as bench_train
from astrai.bench.__main__ import bench_config, main
from astrai.model import preset_model

TINY = ["model=tiny", "batch_size=2", "seq_len=16", "peak_matmul_size=64", "threads=1"]


def test_train_benchmark_cli_writes_a_report(tmp_path):
    out = tmp_path / "train.json"
    report = main(["train", *TINY, "warmup_steps=1", "steps=3", f"out={out}"])
    saved = json.loads(out.read_text())
    assert saved["ratio"] == report["ratio"] > 0
    assert saved["ratio_step_median"] > 0 and saved["ratio_cpu_time"] > 0
    assert saved["ratio_pair_median"] == pytest.approx(saved["ratio"])  # one pair: the same
    for side in ("astrai", "plain"):
        r = saved[side]
        assert r["steps"] == 3 and r["tokens"] == 3 * 2 * 16  # the same timed work
        assert r["tokens_per_s"] > 0 and r["step_median_s"] > 0 and r["mfu"] > 0
        assert r["cpu_seconds"] > 0 and r["mfu_cpu_time"] > 0
        assert len(r["losses"]) == 4  # warm-up step included
        assert r["threads"] == saved["threads"] == 1
    assert saved["peak_flops"] > 0 and saved["peak_source"].startswith("measured")
    assert saved["compile"] is False


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_astrai_and_the_plain_loop_train_the_same_trajectory(model):
    """The Lightning path (LMModule, optimizer builder, Lightning's clipping) and the plain
    loop take the same steps from the same seed; clipping is active (a small max norm), and
    a mixture of experts adds its router balancing loss on both sides."""
    options = [
        f"model={model}",
        "warmup_steps=1",
        "steps=5",
        "gradient_clip_val=0.05",
        "optim.schedule.warmup_steps=1",
    ]
    cfg = bench_config("train", [*(o for o in TINY if not o.startswith("model=")), *options])
    batches = bench_train.make_batches(cfg, vocab=instantiate(cfg["model"])().config.vocab_size)
    ours = bench_train.run_astrai(cfg, batches)["losses"]
    plain = bench_train.run_plain(cfg, batches)["losses"]
    assert max(ours) - min(ours) > 1e-3  # it trains: the trajectory is not flat
    assert ours == pytest.approx(plain, rel=2e-6)  # equal here; summation order aside
    # and the comparison can tell: a different learning rate is a different trajectory
    other = dict(cfg, optim={**cfg["optim"], "lr": cfg["optim"]["lr"] * 1.5})
    assert bench_train.run_plain(other, batches)["losses"] != pytest.approx(plain, rel=1e-5)


def test_flops_per_token_counts_the_model_matmuls():
    for name in ("tiny", "astrai-5m"):
        model = preset_model(name, device="meta")
        config, seq = model.config, 128
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
        expected = 6 * linear + attention * seq  # norms (a few hundred parameters) aside
        assert bench_train.flops_per_token(model, seq) == pytest.approx(expected, rel=0.01)


def test_bad_options_are_refused_naming_them():
    with pytest.raises(SystemExit, match="steps=1"):
        main(["train", *TINY, "steps=1"])
    with pytest.raises(SystemExit, match="precision='16-mixed'"):
        main(["train", *TINY, "precision=16-mixed"])
    with pytest.raises(SystemExit, match="optim"):
        main(["train", *TINY, "optim=sgd"])


def test_compile_without_a_compiler_names_the_option(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"model\.compile=true: .*C\+\+ compiler"):
        preset_model("tiny", device="meta", compile=True)
    assert preset_model("tiny", device="meta").compile_training is False  # off: no check


@pytest.mark.slow
def test_compiled_training_follows_the_eager_trajectory():
    """`model.compile=true` compiles both sides (LMModule.configure_model on the astrai side);
    the losses stay those of eager training."""
    from astrai.model.factory import CXX_COMPILERS

    if not torch.cuda.is_available():
        import shutil

        if not any(shutil.which(c) for c in CXX_COMPILERS):
            pytest.skip("torch.compile on CPU needs a C++ compiler")
    base = [*TINY, "warmup_steps=1", "steps=3"]
    eager = bench_config("train", base)
    compiled = bench_config("train", [*base, "model.compile=true"])
    batches = bench_train.make_batches(eager, instantiate(eager["model"])().config.vocab_size)
    reference = bench_train.run_plain(eager, batches)["losses"]
    ours = bench_train.run_astrai(compiled, batches)["losses"]
    plain = bench_train.run_plain(compiled, batches)["losses"]
    assert all(math.isfinite(x) for x in ours)
    assert ours == pytest.approx(reference, rel=1e-3)
    assert plain == pytest.approx(reference, rel=1e-3)


@pytest.mark.slow
def test_compiled_model_trains_compiled_and_evaluates_eagerly():
    """`compile_for_training` compiles calls with gradients only: a no-grad call (validation,
    reference log-probs) runs eagerly, where Inductor's CPU no-grad lowering fails."""
    from astrai.model.factory import CXX_COMPILERS

    if not torch.cuda.is_available():
        import shutil

        if not any(shutil.which(c) for c in CXX_COMPILERS):
            pytest.skip("torch.compile on CPU needs a C++ compiler")
    torch.manual_seed(0)
    model = preset_model("tiny", compile=True)
    assert model.compile_training and model.compiled_call is None  # the factory only marks it
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    eager = model(ids)
    model.compile_for_training()
    compiled = model(ids)
    compiled.float().sum().backward()
    torch.testing.assert_close(compiled.detach(), eager.detach(), atol=1e-4, rtol=1e-4)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(torch.cat([ids, ids, ids])), model.forward(ids.repeat(3, 1)))


@pytest.mark.parametrize("flag", [False, True])
def test_the_module_compiles_only_a_flagged_model(flag):
    """`model.compile` reaches the strategy's model through Hydra, and `configure_model`
    (Lightning's hook) compiles it once; torch.compile is lazy, so nothing compiles here."""
    from omegaconf import OmegaConf

    from astrai.train.runner import instantiate_strategy

    cfg = bench_config("train", [*TINY, f"model.compile={str(flag).lower()}"])
    module = instantiate_strategy(OmegaConf.create(cfg), None)
    assert module.model.compile_training is flag and module.model.compiled_call is None
    module.configure_model()
    compiled = module.model.compiled_call
    assert (compiled is not None) is flag and module.model_compiled is flag
    module.configure_model()  # Lightning calls it again for validate/test: compiled once
    assert module.model.compiled_call is compiled
