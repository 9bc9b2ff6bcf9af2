"""`python -m astrai.eval adapter=DIR` and lm-eval's `adapter=`: a base model plus a LoRA
adapter served from an engine slot scores and generates exactly as the merged model does
(`merge_lora`, saved with `save_pretrained`): log-likelihoods to 1e-5, the same greedy text.
A bad adapter directory is refused with a message naming `adapter` and the file."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from lm_eval.api.instance import Instance
from omegaconf import OmegaConf
from suite_helpers import write_jsonl

from astrai.eval.__main__ import CONF_DIR, run
from astrai.eval.compare import run as compare_run
from astrai.eval.harness import AstraiLM
from astrai.eval.runner import build_suites, evaluate
from astrai.inference import InferenceEngine
from astrai.model import (
    AutoModel,
    LoRAConfig,
    inject_lora,
    load_lora,
    merge_lora,
    save_lora,
    save_pretrained,
)
from astrai.model.lora import LoRALinear
from astrai.tokenizer import AutoTokenizer

TEXTS = ["def add(a, b):\n    return a + b\n" * 20, "Question: What is 2 + 3?\nAnswer: 5\n" * 20]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DOCS = [TEXTS[0][:400], TEXTS[1][:300], "x = [i * i for i in range(10)]\nprint(sum(x))\n"]
SUITES = [
    "eval=[perplexity,multiple_choice,arithmetic,code]",
    "suites.perplexity.max_length=48",  # documents longer than this: rolling windows
    "suites.multiple_choice.limit=6",
    "suites.arithmetic.num_prompts=4",
    "suites.arithmetic.max_tokens=12",
    "suites.code.limit=2",
    "suites.code.max_tokens=8",
    "suites.code.workers=1",
    "engine.max_batch_size=4",
    "device=cpu",
    "progress=false",
    "threads=1",
]


def config(*overrides: str, name: str = "eval") -> dict:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(name, list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def suites(dirs: dict[str, Path]) -> list[str]:
    """The suite overrides, the perplexity suite on the small local documents."""
    return [*SUITES, f"suites.perplexity.path={dirs['docs']}"]


def save_random_adapter(base: Path, out: Path, *, r: int, seed: int) -> Path:
    """A rank-`r` adapter over every projection of the model in `base`, B random (B starts
    at zero: a no-op adapter would make every comparison pass by accident)."""
    model = AutoModel.from_pretrained(base)
    torch.manual_seed(seed)
    inject_lora(model, LoRAConfig(r=r, lora_alpha=2.0 * r, target_modules=TARGETS))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                torch.nn.init.normal_(module.lora_B.weight, std=0.05)
    return save_lora(model, out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, build_model_dir) -> dict[str, Path]:
    """A base model, a rank-4 adapter over it, the merged model, and an adapter built for
    another base (hidden size 32)."""
    root = tmp_path_factory.mktemp("adapter")
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    shape.update(num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    base = build_model_dir(root / "base", TEXTS, **shape)
    adapter = save_random_adapter(base, root / "my-adapter", r=4, seed=1)
    merged = merge_lora(load_lora(AutoModel.from_pretrained(base), adapter))
    save_pretrained(merged, root / "merged", tokenizer=AutoTokenizer.from_pretrained(base))
    other = build_model_dir(root / "other", TEXTS, hidden_size=32, intermediate_size=64)
    foreign = save_random_adapter(other, root / "foreign", r=2, seed=2)
    docs = write_jsonl(root / "docs.jsonl", [{"text": t} for t in DOCS])
    return {
        "base": base,
        "adapter": adapter,
        "merged": root / "merged",
        "foreign": foreign,
        "docs": docs,
    }


def _assert_same(ours: dict, merged: dict) -> None:
    """Every suite's samples: log-likelihoods to 1e-5, identical generated text."""
    a, b = ours["suites"], merged["suites"]
    assert set(a) == set(b) == {"perplexity", "multiple_choice", "arithmetic", "code"}
    for row, ref in zip(a["perplexity"]["samples"], b["perplexity"]["samples"], strict=True):
        assert row["tokens"] == ref["tokens"] and row["windows"] == ref["windows"]
        assert row["nll"] * row["tokens"] == pytest.approx(ref["nll"] * ref["tokens"], abs=1e-5)
    assert a["perplexity"]["samples"][0]["windows"] > 1  # rolling windows were exercised
    rows = zip(a["multiple_choice"]["samples"], b["multiple_choice"]["samples"], strict=True)
    for row, ref in rows:
        assert row["loglikelihoods"] == pytest.approx(ref["loglikelihoods"], abs=1e-5)
        assert row["greedy"] == ref["greedy"]
    for suite, key in (("arithmetic", "completion"), ("code", "completions")):
        assert [r[key] for r in a[suite]["samples"]] == [r[key] for r in b[suite]["samples"]]
    assert a["arithmetic"]["metrics"] == b["arithmetic"]["metrics"]
    assert a["code"]["metrics"] == b["code"]["metrics"]


def test_base_plus_adapter_equals_the_merged_model(dirs, tmp_path):
    out = tmp_path / "adapter.json"
    run(
        config(
            f"model_path={dirs['base']}", f"adapter={dirs['adapter']}", f"out={out}", *suites(dirs)
        )
    )
    ours = json.loads(out.read_text())
    assert ours["adapter"] == str(dirs["adapter"]) and ours["model_path"] == str(dirs["base"])
    ref_out = tmp_path / "merged.json"
    run(config(f"model_path={dirs['merged']}", f"out={ref_out}", *suites(dirs)))
    merged = json.loads(ref_out.read_text())
    assert merged["adapter"] is None
    _assert_same(ours, merged)
    # the adapter changes the model: base-only scores differ
    base_out = tmp_path / "base.json"
    run(config(f"model_path={dirs['base']}", f"out={base_out}", *suites(dirs)))
    base = json.loads(base_out.read_text())
    nll = ours["suites"]["perplexity"]["metrics"]["nll"]
    assert abs(base["suites"]["perplexity"]["metrics"]["nll"] - nll) > 1e-3


class Recording:
    """An engine that records the adapter of every `score` and `run_batch` request."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_seq_len = engine.max_seq_len
        self.vocab_size = engine.vocab_size
        self.adapters: list[tuple[str, str | None]] = []

    def score(self, requests, params=None, **kw):
        self.adapters.append(("score", None if params is None else params.adapter))
        return self.engine.score(requests, params, **kw)

    def run_batch(self, prompts, params=None, **kw):
        self.adapters.append(("run_batch", None if params is None else params.adapter))
        return self.engine.run_batch(prompts, params, **kw)


def test_every_request_of_every_suite_names_the_adapter(dirs):
    built = build_suites(config(*suites(dirs))["suites"])
    model = AutoModel.from_pretrained(dirs["base"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(dirs["base"])
    lora = {"max_loras": 1, "max_lora_rank": 4}
    with InferenceEngine(model, tokenizer, start=False, max_seq_len=256, lora=lora) as engine:
        engine.load_adapter("mine", dirs["adapter"])
        recording = Recording(engine)
        evaluate(recording, built, adapter="mine")
        calls = list(recording.adapters)
        assert {kind for kind, _ in calls} == {"score", "run_batch"}
        assert {name for _, name in calls} == {"mine"}
        evaluate(recording, built)  # and back to the base
        assert {name for _, name in recording.adapters[len(calls) :]} == {None}


def test_lm_eval_model_with_adapter_equals_the_merged_model(dirs):
    kw = dict(dtype="float32", device="cpu", batch_size=3, max_length=48, page_size=4)
    ours = AstraiLM(pretrained=str(dirs["base"]), adapter=str(dirs["adapter"]), **kw)
    assert ours.engine.lora_enabled and ours.adapter == "my-adapter"
    merged = AstraiLM(pretrained=str(dirs["merged"]), **kw)
    long = " ".join(TEXTS)  # longer than max_length: left-truncated, rolling windows
    reqs = [
        Instance("loglikelihood", {}, ("def add(a, b):", "\n    return a + b"), 0),
        Instance("loglikelihood", {}, ("Question: What is 2 + 3?\nAnswer:", " 5"), 1),
        Instance("loglikelihood", {}, (long, " return"), 2),
    ]
    got, ref = ours.loglikelihood(reqs, disable_tqdm=True), merged.loglikelihood(reqs, True)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, ref, strict=True):
        assert lp == pytest.approx(ref_lp, abs=1e-5) and greedy == ref_greedy
    rolling = [Instance("loglikelihood_rolling", {}, (DOCS[0],), 0)]  # 3 windows
    got_rolling = ours.loglikelihood_rolling(rolling, disable_tqdm=True)
    # a sum over ~130 tokens (about -1000 nats) in fp32: 1e-5 per token, 1e-8 relative
    expected = merged.loglikelihood_rolling(rolling, True)
    assert got_rolling == pytest.approx(expected, rel=1e-7, abs=1e-5)
    gen = [Instance("generate_until", {}, ("def add(a, b):", {"until": ["\n\n"]}), 0)]
    gen[0].arguments[1]["max_gen_toks"] = 10
    assert ours.generate_until(gen, True) == merged.generate_until(gen, True)
    base = AstraiLM(pretrained=str(dirs["base"]), **kw)  # the adapter is not a no-op
    assert abs(base.loglikelihood(reqs[:1], True)[0][0] - got[0][0]) > 1e-3


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda d, tmp: tmp / "nowhere", r"adapter=.*nowhere: not a directory"),
        (lambda d, tmp: tmp, r"adapter=.*adapter file not found: .*adapter_config\.json"),
        (lambda d, tmp: d["foreign"], r"adapter=.*foreign.*adapter_model\.safetensors"),
    ],
)
def test_a_bad_adapter_is_named(dirs, tmp_path, make, message):
    path = make(dirs, tmp_path)
    with pytest.raises(SystemExit, match=message):
        run(config(f"model_path={dirs['base']}", f"adapter={path}", *suites(dirs)))
    with pytest.raises(ValueError, match=message):
        AstraiLM(pretrained=str(dirs["base"]), adapter=str(path), device="cpu")


def test_a_bad_adapter_fails_before_the_model_loads(tmp_path):
    empty = tmp_path / "no_model_here"  # a model's file names, empty: a load would fail
    empty.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (empty / name).write_text("")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    (bad / "adapter_model.safetensors").write_text("")
    with pytest.raises(SystemExit, match=r"adapter=.*bad.*adapter_config\.json: not valid JSON"):
        run(config(f"model_path={empty}", f"adapter={bad}"))


def test_compare_base_against_base_plus_adapter(dirs, tmp_path):
    args = ["eval=[perplexity]", f"suites.perplexity.path={dirs['docs']}", "device=cpu"]
    base = str(dirs["base"])
    cfg = config(f"a={base}", f"b={base}", f"adapter_b={dirs['adapter']}", *args, name="compare")
    data = compare_run(cfg)
    assert data["a"]["adapter"] is None and data["b"]["adapter"] == str(dirs["adapter"])
    a = data["a"]["suites"]["perplexity"]["metrics"]["nll"]
    assert abs(data["b"]["suites"]["perplexity"]["metrics"]["nll"] - a) > 1e-3
    with pytest.raises(SystemExit, match="adapter_a="):
        compare_run({**cfg, "adapter": str(dirs["adapter"])})
    with pytest.raises(SystemExit, match=r"adapter_a=.*nowhere"):
        compare_run({**cfg, "adapter_a": str(tmp_path / "nowhere")})
