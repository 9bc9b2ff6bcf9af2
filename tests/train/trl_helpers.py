"""TRL as the reference for the GRPO tests: a real ``GRPOTrainer`` / ``RLOOTrainer`` on a tiny
random local Llama (nothing is downloaded), whose loss and advantage code runs on tensors we
choose."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 32
EOS_ID, PAD_ID = 1, 0


def hf_parts(root: Path) -> tuple[Path, Any]:
    """A saved tiny random Llama (TRL loads its models from the path) and a word-level
    tokenizer built in memory (``t1`` is EOS, ``t0`` padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(root / "model")
    word = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=word, pad_token="t0", eos_token="t1")
    return root, tok


def _dataset(n: int) -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["t2 t3"] * n})


def _args(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_completion_length": 6,
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        **config,
    }


def _trainer(kind: str, parts: tuple[Path, Any], name: str, reward_funcs: Any, config: dict):
    import trl

    root, tok = parts
    trainer_cls, config_cls = {
        "grpo": (trl.GRPOTrainer, trl.GRPOConfig),
        "rloo": (trl.RLOOTrainer, trl.RLOOConfig),
    }[kind]
    args = _args(config)
    trainer = trainer_cls(
        model=str(root / "model"),
        reward_funcs=reward_funcs,
        args=config_cls(output_dir=str(root / f"out-{kind}-{name}"), **args),
        train_dataset=_dataset(8),
        processing_class=tok,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.get("gradient_accumulation_steps", 1)
    return trainer


def grpo_trainer(parts: tuple[Path, Any], name: str, reward_funcs: Any = None, **config: Any):
    """A ``trl.GRPOTrainer`` (train mode, one accumulation step unless ``config`` says) with
    ``config`` on top of small defaults; rewards 0 unless ``reward_funcs`` is given."""
    zero = lambda completions, **_: [0.0] * len(completions)  # noqa: E731
    return _trainer("grpo", parts, name, reward_funcs or zero, config)


def rloo_trainer(parts: tuple[Path, Any], name: str, reward_funcs: Any, **config: Any):
    """A ``trl.RLOOTrainer`` set up like :func:`grpo_trainer`."""
    return _trainer("rloo", parts, name, reward_funcs, config)


def trl_loss(trainer, logp, old, ref, adv, mask, *, entropies=None, num_items=None, is_ratio=None):
    """TRL's ``_compute_loss`` with its log-prob forward replaced by our fixed tensors;
    ``is_ratio``: its ``importance_sampling_ratio`` input (TRL applies it under vLLM)."""
    n, c = mask.shape
    ent = torch.zeros_like(logp) if entropies is None else entropies
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, ent, None)
    inputs = {
        "prompt_ids": torch.full((n, 2), 2, dtype=torch.long),
        "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.full((n, c), 3, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum() if num_items is None else torch.as_tensor(num_items),
    }
    if is_ratio is not None:
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
        inputs["importance_sampling_ratio"] = is_ratio
    return trainer._compute_loss(trainer.model, inputs)


def scored_by_trl(trainer, completion_ids: list[list[int]], rewards: list[float]) -> dict:
    """TRL's ``_generate_and_score_completions`` on completions and rewards we choose (its
    generation replaced): the advantages, completion mask and token count it trains on."""
    n = len(completion_ids)
    inputs = [{"prompt": "t2 t3", "idx": i} for i in range(n)]
    texts = [" ".join(f"t{t}" for t in ids) for ids in completion_ids]

    import trl

    def generate(prompts):
        if isinstance(trainer, trl.RLOOTrainer):  # its `_generate` returns three lists
            return [[2, 3]] * len(prompts), completion_ids, texts
        return [[2, 3]] * len(prompts), completion_ids, None, texts, None, {}, None, None

    trainer._generate = generate
    trainer.reward_funcs = [lambda completions, idx, **_: [rewards[i] for i in idx]]
    return trainer._generate_and_score_completions(inputs)
