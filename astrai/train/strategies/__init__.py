"""Training strategies: one `LMModule` subclass each (pretrain, sft, dpo, cpo/simpo, orpo,
kto, reward, grpo)."""
