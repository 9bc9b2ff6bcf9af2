"""The PEFT reference of the engine's LoRA tests: a tiny random Llama saved by `transformers`,
adapters saved by PEFT (and one of ours), PEFT's greedy decoding by full recomputation, and
an engine factory over fresh copies of the base. Shared by `test_adapters_engine.py` and
`test_adapters.py`."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.inference import InferenceEngine
from astrai.inference.params import SamplingParams
from astrai.model import AutoModel, LoRAConfig, Transformer, inject_lora, save_lora
from astrai.model.lora import LoRALinear

TOL = 1e-5  # chosen tokens' log-probs vs PEFT's log_softmax (fp32 both sides)
N_TOKENS = 8
ADAPTERS = ("qv", "all", "ours")  # PEFT r=4 on q/v; PEFT rsLoRA r=8 on all 7; ours r=6
TEXTS = [
    "def main(args):",
    "import sys\nimport os\n\nclass Base(object):\n    pass",
    "for i in range(10):\n    print(i)",
    "x = 1",
]
LONG = "def read(path):\n    with open(path) as f:\n        return f.read()\n\nclass Codec(object):"


class SlowTransformer(Transformer):
    """A `Transformer` whose forward can be slowed, so a stream outlasts a load/unload."""

    step_delay: float = 0.0

    def forward_packed(self, *args, **kwargs):
        if self.step_delay:
            time.sleep(self.step_delay)
        return super().forward_packed(*args, **kwargs)


def hf_config(vocab_size: int, hidden: int = 64) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,  # spread-out logits: greedy has no near-ties
        tie_word_embeddings=False,
    )


def peft_adapter(base_dir: Path, out: Path, seed: int, **lora: object) -> Path:
    """A PEFT-saved adapter with random A and B (`init_lora_weights=False`: B is not 0)."""
    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(out)
    return out


# ---------------------------------------------------------------------- fixture bodies
# Each test module declares its fixtures over these (`dirs`, `reference`, `make_engine`).
def build_dirs(tokenizer, tmp_path_factory) -> dict[str, Path]:
    """The HF base directory and the adapters' directories, by name."""
    root = tmp_path_factory.mktemp("lora_engine")
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(len(tokenizer))).float().save_pretrained(root / "base")
    out = {"base": root / "base"}
    out["qv"] = peft_adapter(
        out["base"], root / "qv", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    out["all"] = peft_adapter(
        out["base"],
        root / "all",
        2,
        r=8,
        lora_alpha=12,
        use_rslora=True,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    ours = AutoModel.from_pretrained(out["base"])
    torch.manual_seed(3)
    inject_lora(
        ours, LoRAConfig(r=6, lora_alpha=9.0, target_modules=["k_proj", "o_proj", "up_proj"])
    )
    with torch.no_grad():
        for module in ours.modules():
            if isinstance(module, LoRALinear):
                torch.nn.init.normal_(module.lora_B.weight, std=0.2)
    out["ours"] = save_lora(ours, root / "ours")
    # another base shape (hidden 32): the adapter fits no projection of ours
    torch.manual_seed(4)
    LlamaForCausalLM(hf_config(len(tokenizer), hidden=32)).save_pretrained(root / "small")
    out["foreign"] = peft_adapter(
        root / "small", root / "foreign", 5, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    # rank 32: above every engine's max_lora_rank here
    out["big"] = peft_adapter(
        out["base"], root / "big", 6, r=32, lora_alpha=32, target_modules=["q_proj"]
    )
    return out


def build_reference(dirs: dict[str, Path]):
    """`reference(adapter, prompt_ids, n)`: PEFT's greedy tokens and their log-probs (the
    transformers model alone, with only that adapter loaded; None: the base)."""
    models: dict[str | None, torch.nn.Module] = {}
    memo: dict[tuple, tuple[list[int], list[float]]] = {}

    def model_for(adapter: str | None) -> torch.nn.Module:
        if adapter not in models:
            base = LlamaForCausalLM.from_pretrained(dirs["base"], dtype=torch.float32)
            models[adapter] = (
                base if adapter is None else PeftModel.from_pretrained(base, dirs[adapter])
            ).eval()
        return models[adapter]

    def run(adapter: str | None, prompt: list[int], n: int = N_TOKENS):
        key = (adapter, tuple(prompt), n)
        if key not in memo:
            model, ids, lps = model_for(adapter), list(prompt), []
            with torch.no_grad():
                for _ in range(n):
                    logits = model(torch.tensor([ids])).logits[0, -1].double()
                    top2 = logits.topk(2).values
                    assert top2[0] - top2[1] > 1e-3, "near-tie in the reference: other prompts"
                    token = int(logits.argmax())
                    lps.append(float(torch.log_softmax(logits, -1)[token]))
                    ids.append(token)
            memo[key] = (ids[len(prompt) :], lps)
        return memo[key]

    run.model_for = model_for
    return run


def engine_factory(dirs: dict[str, Path], tokenizer):
    """`make_engine(**kwargs)`: an engine over a fresh copy of the base (adapter slots hook
    the model's projections, so engines never share one), shut down after the test."""
    engines = []

    def make(*, model_cls: type[Transformer] = Transformer, load=(), **kwargs):
        loaded = AutoModel.from_pretrained(dirs["base"])
        model = loaded
        if model_cls is not Transformer:
            model = model_cls(loaded.config)
            model.load_state_dict(loaded.state_dict())
            model.eval()
        kwargs.setdefault("lora", {"max_loras": 4, "max_lora_rank": 16})
        kwargs.setdefault("max_batch_size", 16)
        kwargs.setdefault("max_seq_len", 128)
        if kwargs.get("cache_mode") == "paged":
            kwargs.setdefault("page_size", 4)
            kwargs.setdefault("kv_tokens", 4096)
        engine = InferenceEngine(model, tokenizer, **kwargs)
        engines.append(engine)
        for name in load:
            engine.load_adapter(name, dirs[name])
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


def greedy(**extra) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": N_TOKENS, "ignore_eos": True, **extra}
    )


def assert_exact(got_ids, got_lps, want, label) -> None:
    want_ids, want_lps = want
    assert got_ids == want_ids, f"{label}: tokens differ from PEFT's"
    assert len(got_lps) == len(want_lps), label
    worst = max(abs(a - b) for a, b in zip(got_lps, want_lps))
    assert worst <= TOL, f"{label}: log-probs differ from PEFT's by {worst:.2e}"


def slot_names(engine: InferenceEngine) -> list[str | None]:
    return [None if a is None else a.info.name for a in engine.adapters.slots.holder]
