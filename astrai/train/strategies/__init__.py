"""Training strategies: one `LMModule` subclass each (pretrain, sft, dpo, grpo)."""
