"""Eval-generation callback: live weights, metrics, sample tables, RNG isolation."""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from astrai.model import ModelConfig, Transformer
from astrai.train.eval_generation import EvalGenerationCallback, builtin_prompts


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


def test_builtin_prompts():
    recs, chat = builtin_prompts("arithmetic", 5)
    assert chat and len(recs) == 5 and all("answer" in r for r in recs)
    recs, chat = builtin_prompts("stdlib", 3)
    assert not chat and len(recs) == 3 and all(r["prompt"].endswith("\n") for r in recs)
    with pytest.raises(ValueError, match="unknown task"):
        builtin_prompts("nope", 1)
    with pytest.raises(ValueError, match="exactly one"):
        EvalGenerationCallback()
    with pytest.raises(KeyError, match="available"):
        EvalGenerationCallback(task="arithmetic", metric="nope")


def test_evaluates_live_weights_logs_metrics_and_keeps_rng(tok, tmp_path):
    model = _model(tok)
    module = SimpleNamespace(model=model, tokenizer=tok, device=torch.device("cpu"))
    logger = mock.MagicMock()
    cb = EvalGenerationCallback(task="arithmetic", num_prompts=4, max_tokens=8, every_n_steps=2)
    trainer = _trainer(tmp_path, 0, [logger])

    rng = torch.random.get_rng_state()
    metrics = cb.evaluate(trainer, module)
    assert torch.equal(rng, torch.random.get_rng_state())  # training randomness untouched
    assert set(metrics) >= {"eval/exact_match", "eval/completion_len"}
    logger.log_metrics.assert_called_once()
    assert logger.log_metrics.call_args.kwargs["step"] == 0

    def expected(m):
        return [
            tok.decode(_greedy(m, p, 8, set(tok.stop_ids)), skip_special_tokens=True)
            for p in cb._prompt_ids
        ]

    rows = [json.loads(x) for x in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in rows] == expected(model)
    # chat template: the prompt ids are the rendered user turn plus the generation prompt
    assert cb._prompt_ids[0] == tok.apply_chat_template(
        [{"role": "user", "content": cb.records[0]["prompt"]}],
        add_generation_prompt=True,
        tokenize=True,
    )

    # New weights after an optimizer step: the next evaluation sees them (no stale cache).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.global_step = 2
    cb.evaluate(trainer, module)
    assert cb._engine.scheduler.policy_version == 2
    rows = [json.loads(x) for x in (tmp_path / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in rows if r["step"] == 2] == expected(model)
    # Metric per row is the registered reward of that row.
    from astrai.data.rewards import exact_match

    for r in rows:
        assert r["exact_match"] == exact_match({"answer": r["answer"]}, r["completion"])
    cb.teardown(trainer, module, "fit")
    assert cb._engine is None


def test_engine_factory_gets_sizes_from_the_prompts(tok, tmp_path):
    """The callback calls its engine factory (conf/engine/) with its own batch and context."""
    from hydra.utils import instantiate

    from astrai.inference import InferenceEngine
    from astrai.train.runner import compose

    cfg = compose(["callbacks=eval_generation", "paths.output_dir=/tmp/unused"])
    node = cfg.callbacks.eval_generation.engine
    assert node.cache_mode == "contiguous" and node._target_ == "astrai.inference.InferenceEngine"
    factory = mock.Mock(side_effect=instantiate(node))
    model = _model(tok)
    module = SimpleNamespace(model=model, tokenizer=tok, device=torch.device("cpu"))
    cb = EvalGenerationCallback(task="arithmetic", num_prompts=3, max_tokens=8, engine=factory)
    cb.evaluate(_trainer(tmp_path), module)
    (args, kw) = factory.call_args
    assert args == (model, tok) and kw["start"] is False and kw["max_batch_size"] == 3
    longest = max(len(p) for p in cb._prompt_ids) + 8
    assert kw["max_seq_len"] == max(longest, 64)
    assert isinstance(cb._engine, InferenceEngine) and cb._engine.max_seq_len == kw["max_seq_len"]
    cb.teardown(_trainer(tmp_path), module, "fit")


def test_hook_schedule_and_wandb_table(tok, tmp_path):
    from lightning.pytorch.loggers import WandbLogger

    module = SimpleNamespace(model=_model(tok), tokenizer=tok, device=torch.device("cpu"))
    wandb = mock.create_autospec(WandbLogger, instance=True)
    cb = EvalGenerationCallback(
        prompts=["def main(", {"prompt": "What is 1 + 1?", "answer": "2"}],
        chat=False,
        max_tokens=4,
        every_n_steps=3,
        metric="exact_match",
    )
    trainer = _trainer(tmp_path, 0, [wandb])
    cb.on_train_start(trainer, module)  # at_start
    for step in (1, 2, 3, 3, 4):  # 3 twice: gradient accumulation repeats a global step
        trainer.global_step = step
        cb.on_train_batch_end(trainer, module, None, None, 0)
    trainer.global_step = 5
    cb.on_train_end(trainer, module)  # at_end
    assert [h["step"] for h in cb.history] == [0, 3, 5]
    # exact_match only where the record has an answer: 1 of 2 prompts scored
    assert wandb.log_table.call_count == 3
    kwargs = wandb.log_table.call_args.kwargs
    assert kwargs["key"] == "eval/samples" and kwargs["step"] == 5
    assert kwargs["columns"][:3] == ["step", "prompt", "completion"]
    assert len(kwargs["data"]) == 2
    # Non-zero ranks generate nothing.
    trainer.is_global_zero = False
    trainer.global_step = 6
    assert cb.evaluate(trainer, module) == {}
    cb.teardown(trainer, module, "fit")
