"""Evaluation callback: suites on the live weights, metrics, sample tables, RNG isolation."""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from astrai.eval import GenerationSuite, Suite, SuiteResult
from astrai.model import ModelConfig, Transformer
from astrai.train.evaluation import EvalCallback


@pytest.fixture(scope="module")
def tok():
    from astrai.data.builtin import arithmetic_problems, sft_records
    from astrai.tokenizer import AutoTokenizer

    texts = [m["content"] for r in sft_records(arithmetic_problems(300)) for m in r["messages"]]
    return AutoTokenizer.train(texts * 2, vocab_size=320)


def _model(tok) -> Transformer:
    cfg = ModelConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.15,  # spread-out logits: greedy has no near-ties
    )
    torch.manual_seed(0)
    return Transformer(cfg)


def _trainer(tmp_path, step=0, loggers=()):
    from lightning.pytorch.strategies import SingleDeviceStrategy

    return SimpleNamespace(
        global_step=step,
        is_global_zero=True,
        loggers=list(loggers),
        strategy=SingleDeviceStrategy(device=torch.device("cpu")),
        default_root_dir=str(tmp_path),
        sanity_checking=False,
    )


def _greedy(model, prompt, n, stop):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(nxt)
            if nxt in stop:
                break
    return ids[len(prompt) :]


class CountingSuite(Suite):
    """Records the engine and weights version it was run on."""

    name = "counting"

    def __init__(self, need: int = 40) -> None:
        self.need, self.calls = need, []

    def required_seq_len(self, tokenizer) -> int:
        return self.need

    def run(self, engine, *, progress=False) -> SuiteResult:
        self.calls.append(engine.policy_version)
        return SuiteResult(self.name, {"score": 0.5}, [{"item": 1}, {"item": 2}], 0.25)


def test_bad_suites_are_refused():
    with pytest.raises(ValueError, match="no suites"):
        EvalCallback({})
    with pytest.raises(ValueError, match=r"suites\.x must be an astrai\.eval\.Suite"):
        EvalCallback({"x": {"task": "arithmetic"}})


def test_evaluates_live_weights_logs_metrics_and_keeps_rng(tok, tmp_path):
    model = _model(tok)
    module = SimpleNamespace(model=model, tokenizer=tok, device=torch.device("cpu"))
    logger = mock.MagicMock()
    suite = GenerationSuite("arithmetic", task="arithmetic", num_prompts=4, max_tokens=8)
    cb = EvalCallback({"arithmetic": suite, "other": CountingSuite()}, every_n_steps=2)
    trainer = _trainer(tmp_path, 0, [logger])

    rng = torch.random.get_rng_state()
    metrics = cb.evaluate(trainer, module)
    assert torch.equal(rng, torch.random.get_rng_state())  # training randomness untouched
    assert set(metrics) >= {
        "eval/arithmetic/exact_match",
        "eval/arithmetic/completion_len",
        "eval/arithmetic/count",
        "eval/other/score",
        "eval/other/seconds",
    }
    assert metrics["eval/arithmetic/count"] == 4 and metrics["eval/other/count"] == 2
    assert metrics["eval/other/score"] == 0.5 and metrics["eval/other/seconds"] == 0.25
    logger.log_metrics.assert_called_once()
    assert logger.log_metrics.call_args.kwargs["step"] == 0

    prompts = suite.encode(tok)

    def expected(m):
        stop = set(tok.stop_ids)
        return [tok.decode(_greedy(m, p, 8, stop), skip_special_tokens=True) for p in prompts]

    def rows(step):
        lines = (tmp_path / "eval_samples.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["step"] == step]

    assert [r["completion"] for r in rows(0) if r["suite"] == "arithmetic"] == expected(model)
    assert [r["item"] for r in rows(0) if r["suite"] == "other"] == [1, 2]

    # New weights after an optimizer step: the next evaluation sees them (no stale cache).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.global_step = 2
    cb.evaluate(trainer, module)
    assert cb.engine.policy_version == 2 and cb.suites["other"].calls == [0, 2]
    assert [r["completion"] for r in rows(2) if r["suite"] == "arithmetic"] == expected(model)
    from astrai.data.rewards import exact_match

    for r in rows(2):
        if r["suite"] == "arithmetic":
            assert r["exact_match"] == exact_match({"answer": r["answer"]}, r["completion"])
    cb.teardown(trainer, module, "fit")
    assert cb.engine is None


def test_engine_factory_is_sized_by_the_suites(tok, tmp_path):
    """The callback calls its engine factory (conf/engine/) with the suites' context."""
    from hydra.utils import instantiate

    from astrai.inference import InferenceEngine
    from astrai.train.runner import compose

    cfg = compose(["callbacks=eval", "paths.output_dir=/tmp/unused"])
    node = cfg.callbacks.eval.engine
    assert node.cache_mode == "contiguous" and node._target_ == "astrai.inference.InferenceEngine"
    assert cfg.callbacks.eval.suites.arithmetic._target_ == "astrai.eval.GenerationSuite"
    factory = mock.Mock(side_effect=instantiate(node))
    model = _model(tok)
    module = SimpleNamespace(model=model, tokenizer=tok, device=torch.device("cpu"))
    cb = EvalCallback(
        {"small": CountingSuite(40), "large": CountingSuite(100)},
        engine=factory,
        max_batch_size=3,
    )
    cb.evaluate(_trainer(tmp_path), module)
    (args, kw) = factory.call_args
    assert args == (model, tok) and kw["start"] is False and kw["max_batch_size"] == 3
    assert kw["max_seq_len"] == 100  # the largest need
    assert isinstance(cb.engine, InferenceEngine) and cb.engine.max_seq_len == 100
    cb.teardown(_trainer(tmp_path), module, "fit")


def test_hook_schedule_and_wandb_table(tok, tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    module = SimpleNamespace(model=_model(tok), tokenizer=tok, device=torch.device("cpu"))
    wandb = mock.create_autospec(WandbLogger, instance=True)
    suite = GenerationSuite(
        "mixed",
        prompts=["def main(", {"prompt": "What is 1 + 1?", "answer": "2"}],
        chat=False,
        max_tokens=4,
        metrics="exact_match",
    )
    cb = EvalCallback({"mixed": suite}, every_n_steps=3)
    trainer = _trainer(tmp_path, 0, [wandb])
    cb.on_train_start(trainer, module)  # at_start
    for step in (1, 2, 3, 3, 4):  # 3 twice: gradient accumulation repeats a global step
        trainer.global_step = step
        cb.on_train_batch_end(trainer, module, None, None, 0)
    trainer.global_step = 5
    cb.on_train_end(trainer, module)  # at_end
    assert [h["step"] for h in cb.history] == [0, 3, 5]
    assert wandb.log_table.call_count == 3
    kwargs = wandb.log_table.call_args.kwargs
    assert kwargs["key"] == "eval/mixed/samples" and kwargs["step"] == 5
    assert kwargs["columns"][:2] == ["step", "suite"] and "completion" in kwargs["columns"]
    assert len(kwargs["data"]) == 2
    # Non-zero ranks evaluate nothing.
    trainer.is_global_zero = False
    trainer.global_step = 6
    assert cb.evaluate(trainer, module) == {}
    cb.teardown(trainer, module, "fit")


def test_a_lora_policy_is_evaluated_through_its_live_adapter(tok, tmp_path):
    """With LoRA (dropout on, the module in train mode, as Lightning keeps it), evaluation
    runs the live adapter from the engine's slot, without dropout: its completions are the
    merged policy's, before and after the adapter trains (the versioned update re-reads it)."""
    import copy

    from astrai.inference.adapters import LIVE_ADAPTER
    from astrai.model import LoRAConfig, inject_lora, merge_lora

    model = _model(tok)
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, lora_dropout=0.5))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    model.train()
    module = SimpleNamespace(model=model, tokenizer=tok, device=torch.device("cpu"))
    suite = GenerationSuite("arithmetic", task="arithmetic", num_prompts=4, max_tokens=8)
    cb = EvalCallback({"arithmetic": suite}, every_n_steps=1)
    trainer = _trainer(tmp_path, 0)
    prompts = suite.encode(tok)
    stop = set(tok.stop_ids)

    def completions(step):
        lines = (tmp_path / "eval_samples.jsonl").read_text().splitlines()
        return [r["completion"] for r in map(json.loads, lines) if r["step"] == step]

    def merged_completions():
        merged = merge_lora(copy.deepcopy(model)).eval()
        return [tok.decode(_greedy(merged, p, 8, stop), skip_special_tokens=True) for p in prompts]

    cb.evaluate(trainer, module)
    assert cb.engine.adapters.default.info.name == LIVE_ADAPTER
    assert completions(0) == merged_completions()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.2 * torch.randn_like(p))
    trainer.global_step = 1
    cb.evaluate(trainer, module)
    assert completions(1) == merged_completions()
    assert completions(1) != completions(0)
    assert model.training  # the module's mode is Lightning's, untouched
    cb.teardown(trainer, module, "fit")


def test_validation_metrics_share_the_evaluation_step_index(tmp_path):
    """#54.11: `val/*` at `trainer.global_step`, the index `EvalCallback` logs `eval/*` at
    (Lightning's own would be one lower: `val/loss` of the weights after step 2 at step 1)."""
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from astrai.train.evaluation import ValidationStep

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, idx):
            return self.layer(batch).pow(2).mean()

        def validation_step(self, batch, idx):
            self.log("val/loss", self.layer(batch).pow(2).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    seen = []

    class GlobalStep(L.Callback):  # what EvalCallback reads for its step
        def on_validation_end(self, trainer, pl_module):
            seen.append(trainer.global_step)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        callbacks=[ValidationStep(), GlobalStep()],
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = DataLoader(torch.randn(40, 4), batch_size=2)
    trainer.fit(Tiny(), data, DataLoader(torch.randn(4, 4), batch_size=2))
    (metrics,) = tmp_path.rglob("metrics.csv")
    with open(metrics) as fh:
        steps = [int(r["step"]) for r in csv.DictReader(fh) if r["val/loss"]]
    assert steps == seen == [2, 4]
