"""The HF export check the model-family tests share."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from astrai.model import AutoModel, save_pretrained

# A tiny HF config's sizes for the families' own tests (OLMo 2, Phi-3)
SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.15,  # spread-out logits: greedy has no near-ties
)


def assert_export_round_trip(hf: torch.nn.Module, tmp_path: Path, x: torch.Tensor) -> None:
    """`hf` saved by transformers, imported by us, exported in HF format: the export has the
    tensor names transformers itself writes, loads as the same class, and every model gives
    the same logits (fp32, 1e-5)."""
    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "export", hf_format=True)
    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert keys == set(f.keys())  # the names transformers itself writes
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ours(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=0)


def assert_engine_greedy_equals_hf(hf: torch.nn.Module, tmp_path: Path, tokenizer) -> None:
    """`hf` imported and served by the paged engine: its greedy tokens equal transformers'
    greedy `generate` for prompts of several lengths (one batch, ragged)."""
    from astrai.inference import InferenceEngine

    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModel.from_pretrained(tmp_path / "hf")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, len(tokenizer), (n,), generator=gen).tolist() for n in (5, 19, 33)]
    n = 8
    with InferenceEngine(
        ours, tokenizer, cache_mode="paged", page_size=8, max_seq_len=128, start=False
    ) as eng:
        out = eng.run_batch(prompts, max_tokens=n, temperature=0.0, ignore_eos=True)
    for prompt, got in zip(prompts, out):
        assert got == hf_greedy(hf, prompt, n)


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy `generate`: exactly `n` new token ids after `prompt`."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_lora_trains(hf: torch.nn.Module, tmp_path: Path) -> None:
    """A LoRA on every projection of the imported model trains: the loss on a fixed batch
    falls, only adapter weights change, and merging keeps the adapted logits."""
    from astrai.model import LoRAConfig, inject_lora, merge_lora

    hf.save_pretrained(tmp_path / "hf")
    model = AutoModel.from_pretrained(tmp_path / "hf").train()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, target_modules=targets))
    x = torch.randint(
        0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5)
    )
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for _ in range(8):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    model.eval()
    with torch.no_grad():
        adapted = model(x)
        merge_lora(model)
        torch.testing.assert_close(model(x), adapted, atol=1e-4, rtol=0)


GPT_OSS_WINDOW = 8
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,
}
GPT_OSS_SIZES = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=GPT_OSS_WINDOW,
    max_position_embeddings=128,
    swiglu_limit=0.8,
    initializer_range=0.2,  # spread-out logits: greedy has no near-ties
    rope_parameters=GPT_OSS_YARN,
)


def build_gpt_oss(vocab: int = 256) -> transformers.GptOssForCausalLM:
    """A tiny random GPT-OSS: alternating sliding / full layers (window 8), non-zero sinks and
    biases, a SwiGLU limit the activations cross, YaRN with `truncate: false`."""
    config = transformers.GptOssConfig(vocab_size=vocab, **GPT_OSS_SIZES)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises the expert biases to zero
        for name, p in model.named_parameters():
            if name.endswith("_bias") or name.endswith("sinks") or name.endswith("router.bias"):
                p.normal_(0.0, 0.5)
    return model
