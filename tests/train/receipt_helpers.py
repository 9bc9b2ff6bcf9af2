"""The run the receipt and verify tests share: tiny SFT with the ledger, checkpoints every
2 of 4 steps and an end-of-run evaluation (4 arithmetic prompts)."""

from __future__ import annotations

from pathlib import Path

from train_helpers import TINY_MODEL

RECEIPT_RUN = [
    "+experiment=tiny_sft",
    *TINY_MODEL,
    "tokenizer.train.max_bytes=400000",
    "data.train.prepare.builtin.n=64",
    "data.val.prepare.builtin.n=8",
    "data.batch_size=8",
    "trainer.max_steps=4",
    "trainer.limit_val_batches=0",
    "ledger=true",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "callbacks.model_checkpoint.save_top_k=-1",
    "callbacks.eval.every_n_steps=0",
    "callbacks.eval.at_start=false",
    "callbacks.eval.suites.arithmetic.num_prompts=4",
    "callbacks.eval.suites.arithmetic.max_tokens=8",
    "callbacks.progress_bar=null",
    "trainer.enable_model_summary=false",
]


def receipt_run(reference_run) -> Path:
    return reference_run("receipt", RECEIPT_RUN)
