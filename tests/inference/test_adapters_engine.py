"""Many LoRA adapters over one base, at the engine level (issue #33), against PEFT.

The reference is independent of astrai: a tiny random Llama built and saved by
`transformers`, wrapped by `peft.PeftModel` with one adapter at a time, decoded greedily by
full recomputation. The engine loads that directory (`AutoModel.from_pretrained`) and
three adapters: two saved by PEFT (different ranks and targets, one rsLoRA) and one of ours
(`inject_lora` + `save_lora`); a batch mixing them and the base must give every row
PEFT's tokens and log-probs, whatever the cache mode and the number of device slots.
Also: no KV crosses adapters in the prefix cache, load errors name the file and the limit,
adapters load and unload while streams run, and the slot table evicts the least recently
used idle adapter.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from astrai.inference import InferenceEngine
from astrai.inference.adapters import AdapterError, AdapterInUse, AdapterNotFound
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


def _hf_config(vocab_size: int, hidden: int = 64) -> LlamaConfig:
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


def _peft_adapter(base_dir: Path, out: Path, seed: int, **lora: object) -> Path:
    """A PEFT-saved adapter with random A and B (`init_lora_weights=False`: B is not 0)."""
    torch.manual_seed(seed)
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(out)
    return out


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def dirs(tokenizer, tmp_path_factory) -> dict[str, Path]:
    """The HF base directory and the adapters' directories, by name."""
    root = tmp_path_factory.mktemp("lora_engine")
    torch.manual_seed(0)
    LlamaForCausalLM(_hf_config(len(tokenizer))).float().save_pretrained(root / "base")
    out = {"base": root / "base"}
    out["qv"] = _peft_adapter(
        out["base"], root / "qv", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    out["all"] = _peft_adapter(
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
    LlamaForCausalLM(_hf_config(len(tokenizer), hidden=32)).save_pretrained(root / "small")
    out["foreign"] = _peft_adapter(
        root / "small", root / "foreign", 5, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    # rank 32: above every engine's max_lora_rank here
    out["big"] = _peft_adapter(
        out["base"], root / "big", 6, r=32, lora_alpha=32, target_modules=["q_proj"]
    )
    return out


@pytest.fixture(scope="module")
def reference(dirs):
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


@pytest.fixture
def make_engine(dirs, tokenizer):
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


def _greedy(**extra) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": N_TOKENS, "ignore_eos": True, **extra}
    )


def _assert_exact(got_ids, got_lps, want, label) -> None:
    want_ids, want_lps = want
    assert got_ids == want_ids, f"{label}: tokens differ from PEFT's"
    assert len(got_lps) == len(want_lps), label
    worst = max(abs(a - b) for a, b in zip(got_lps, want_lps))
    assert worst <= TOL, f"{label}: log-probs differ from PEFT's by {worst:.2e}"


def _slot_names(engine: InferenceEngine) -> list[str | None]:
    return [None if a is None else a.info.name for a in engine.adapters.slots.holder]


# ---------------------------------------------------------------------- 1. equality vs PEFT
ENGINE_SETTINGS = {
    "contiguous": {},
    "paged-prefix": {"cache_mode": "paged", "prefix_cache": True},
    "two-slots": {"lora": {"max_loras": 2, "max_lora_rank": 16}},
    "paged-one-slot": {
        "cache_mode": "paged",
        "prefix_cache": True,
        "lora": {"max_loras": 1, "max_lora_rank": 16},
    },
}


@pytest.mark.parametrize("settings", ENGINE_SETTINGS.values(), ids=ENGINE_SETTINGS.keys())
def test_mixed_batch_matches_peft(make_engine, tokenizer, reference, settings):
    """The base and three adapters, several prompts each, submitted together so they share
    steps (and, with fewer slots than adapters, wait for one): every row is PEFT's."""
    engine = make_engine(start=False, load=ADAPTERS, **settings)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    jobs = [(a, p) for p in prompts for a in (None, *ADAPTERS)]  # interleaved adapters
    results = [engine.submit(p, _greedy(logprobs_mode="raw"), adapter=a) for a, p in jobs]
    engine.start()
    for (adapter, prompt), result in zip(jobs, results):
        result.wait_completion(timeout=60)
        assert result.finish_reason == "length", result.task.error
        _assert_exact(
            result.token_ids, result.logprobs, reference(adapter, prompt), f"submit {adapter}"
        )
    slots = engine.adapters.slots
    assert slots.users == [0] * len(slots.users)  # every finished request released its slot
    if len(slots.holder) >= len(ADAPTERS):  # all rows fit at once: they shared their steps
        assert engine.get_stats()["steps"] <= N_TOKENS + 1
    # every adapter changes the greedy tokens (a no-op adapter would pass by accident)
    for adapter in ADAPTERS:
        assert any(reference(adapter, p)[0] != reference(None, p)[0] for p in prompts), adapter

    for adapter in (None, *ADAPTERS):  # run_batch, one adapter per call
        out = engine.run_batch(
            prompts,
            temperature=0,
            max_tokens=N_TOKENS,
            ignore_eos=True,
            logprobs_mode="raw",
            return_logprobs=True,
            adapter=adapter,
        )
        for prompt, (ids, lps) in zip(prompts, out):
            _assert_exact(ids, lps, reference(adapter, prompt), f"run_batch {adapter}")


def test_score_under_adapters_matches_peft(make_engine, tokenizer, reference):
    """`score` (the prompt log-probs path) under each adapter: PEFT's log_softmax."""
    engine = make_engine(load=ADAPTERS, cache_mode="paged", prefix_cache=True)
    context, continuation = tokenizer.encode(TEXTS[1])[:10], tokenizer.encode(TEXTS[2])[:6]
    for adapter in (None, *ADAPTERS):
        (scored,) = engine.score([(context, continuation)], SamplingParams(adapter=adapter))
        ids = torch.tensor([context + continuation])
        with torch.no_grad():
            logits = reference.model_for(adapter)(ids).logits[0].double()
        want = torch.log_softmax(logits, -1)[len(context) - 1 : -1]
        want = want.gather(1, torch.tensor(continuation)[:, None])[:, 0].tolist()
        got = [t.logprob for t in scored.tokens]
        assert [t.token_id for t in scored.tokens] == continuation
        assert max(abs(a - b) for a, b in zip(got, want)) <= TOL, adapter


# ---------------------------------------------------------------------- 2. no shared KV
def test_prefix_cache_never_crosses_adapters(make_engine, tokenizer, reference, dirs):
    """One long prompt under A, then B and the base: no prefix-cache hits from A's pages,
    and their outputs are their own; the same prompt again under A hits."""
    engine = make_engine(load=ADAPTERS, cache_mode="paged", prefix_cache=True)
    prompt = tokenizer.encode(LONG)
    assert len(prompt) >= 16

    def run(adapter):
        (out,) = engine.run_batch([prompt], _greedy(), return_details=True, adapter=adapter)
        _assert_exact(out.token_ids, out.logprobs, reference(adapter, prompt), str(adapter))
        return out.cached_prompt_tokens

    assert run("qv") == 0
    before = engine.get_stats()["cached_prompt_tokens"]
    assert run("all") == 0, "adapter 'all' was served KV computed under 'qv'"
    assert run(None) == 0, "the base was served KV computed under 'qv'"
    assert engine.get_stats()["cached_prompt_tokens"] == before
    # streamed requests count the same way (GenerateResult's task)
    streamed = engine.submit(prompt, _greedy(), adapter="ours")
    streamed.wait_completion(timeout=60)
    assert streamed.task.cached_tokens == 0
    _assert_exact(streamed.token_ids, streamed.logprobs, reference("ours", prompt), "ours")

    page = 4
    whole_pages = (len(prompt) - 1) // page * page
    assert run("qv") >= whole_pages > 0  # the same adapter does hit
    assert run(None) >= whole_pages  # and so does the base, on its own pages
    # a reload under the same name is another adapter: A's old pages are not its
    engine.unload_adapter("qv")
    engine.load_adapter("qv", dirs["qv"])
    assert run("qv") == 0


# ---------------------------------------------------------------------- 3. load errors
def test_load_errors_name_the_file_and_the_limit(make_engine, dirs, tmp_path):
    engine = make_engine(lora={"max_loras": 2, "max_lora_rank": 4})
    with pytest.raises(AdapterError) as err:  # rank 8 > 4
        engine.load_adapter("all", dirs["all"])
    msg = str(err.value)
    assert str(dirs["all"] / "adapter_config.json") in msg
    assert "max_lora_rank (4)" in msg and "r=8" in msg

    with pytest.raises(AdapterError) as err:  # a hidden-32 model's adapter
        engine.load_adapter("foreign", dirs["foreign"])
    msg = str(err.value)
    assert str(dirs["foreign"] / "adapter_model.safetensors") in msg
    assert "another base model" in msg

    with pytest.raises(AdapterError, match="file not found") as err:
        engine.load_adapter("nowhere", tmp_path / "nowhere")
    assert str(tmp_path / "nowhere" / "adapter_config.json") in str(err.value)
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text((dirs["qv"] / "adapter_config.json").read_text())
    with pytest.raises(AdapterError, match="file not found") as err:
        engine.load_adapter("half", half)
    assert str(half / "adapter_model.safetensors") in str(err.value)

    assert engine.list_adapters() == []  # failed loads leave nothing behind
    info = engine.load_adapter("qv", dirs["qv"])
    assert (info.name, info.rank, info.path) == ("qv", 4, str(dirs["qv"]))
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_adapter("qv", dirs["ours"])
    assert [a.path for a in engine.list_adapters()] == [str(dirs["qv"])]


def test_max_cpu_loras_refuses_one_more(make_engine, dirs):
    engine = make_engine(lora={"max_loras": 1, "max_lora_rank": 16, "max_cpu_loras": 2})
    engine.load_adapter("a", dirs["qv"])
    engine.load_adapter("b", dirs["all"])
    with pytest.raises(AdapterError, match=r"max_cpu_loras") as err:
        engine.load_adapter("c", dirs["ours"])
    assert "2 adapters are loaded" in str(err.value)
    assert [a.name for a in engine.list_adapters()] == ["a", "b"]
    engine.unload_adapter("a")
    engine.load_adapter("c", dirs["ours"])
    assert [a.name for a in engine.list_adapters()] == ["b", "c"]


def test_unknown_adapter_is_refused_before_queueing(make_engine, tokenizer, dirs):
    engine = make_engine(load=["qv"])
    prompt = tokenizer.encode(TEXTS[0])
    before = engine.get_stats()["total_tasks"]
    with pytest.raises(AdapterNotFound, match="'nope'"):
        engine.submit(prompt, _greedy(), adapter="nope")
    with pytest.raises(AdapterNotFound, match="'nope'"):
        engine.generate(TEXTS[0], _greedy(adapter="nope"))
    with pytest.raises(AdapterNotFound, match="'nope'"):
        # one bad prompt's adapter: nothing of the batch runs
        engine.run_batch([prompt, prompt], _greedy(), adapter="nope")
    assert engine.get_stats()["total_tasks"] == before
    assert not engine.scheduler.has_work()


def test_score_with_unknown_adapter_raises_adapter_not_found(make_engine, tokenizer):
    """`score` checks each request too; the error keeps its type (a 404, not a 400)."""
    engine = make_engine(load=["qv"])
    ids = tokenizer.encode(TEXTS[0])
    with pytest.raises(AdapterNotFound, match="'nope'"):
        engine.score([(ids, ids)], SamplingParams(adapter="nope"))


def test_engine_without_lora_names_how_to_enable(make_engine, tokenizer, dirs):
    engine = make_engine(lora=None)
    assert not engine.lora_enabled and engine.list_adapters() == []
    with pytest.raises(AdapterNotFound, match=r"lora=") as err:
        engine.submit(tokenizer.encode(TEXTS[0]), _greedy(), adapter="qv")
    assert "'qv'" in str(err.value)
    with pytest.raises(AdapterNotFound, match=r"lora="):
        engine.run_batch([tokenizer.encode(TEXTS[0])], _greedy(), adapter="qv")
    with pytest.raises(AdapterError, match=r"lora="):
        engine.load_adapter("qv", dirs["qv"])
    assert engine.get_stats()["total_tasks"] == 0


# ---------------------------------------------------------------------- 4. live loading
def test_load_and_unload_while_a_stream_runs(make_engine, tokenizer, reference, dirs):
    engine = make_engine(
        model_cls=SlowTransformer,
        load=["qv", "all"],
        lora={"max_loras": 2, "max_lora_rank": 16},
    )
    prompt = tokenizer.encode(TEXTS[1])
    n = 40
    engine.model.step_delay = 0.02
    stream = engine.submit(prompt, _greedy(max_tokens=n), adapter="qv")
    deadline = time.monotonic() + 30
    while len(stream.token_ids) < 2:
        assert time.monotonic() < deadline and not stream.done
        time.sleep(0.005)

    errors: list[BaseException] = []

    def change() -> None:
        try:
            engine.load_adapter("ours", dirs["ours"])
            engine.unload_adapter("all")
        except BaseException as err:  # reported on the main thread
            errors.append(err)

    worker = threading.Thread(target=change)
    worker.start()
    with pytest.raises(AdapterInUse, match="'qv'"):
        engine.unload_adapter("qv")
    worker.join(30)
    assert not errors, errors
    assert not stream.done, "the stream ended before the load/unload: slow the model more"
    assert sorted(a.name for a in engine.list_adapters()) == ["ours", "qv"]
    stream.wait_completion(timeout=60)
    engine.model.step_delay = 0.0
    _assert_exact(stream.token_ids, stream.logprobs, reference("qv", prompt, n), "qv stream")

    with pytest.raises(AdapterNotFound, match="'all'"):
        engine.submit(prompt, _greedy(), adapter="all")
    with pytest.raises(AdapterNotFound):
        engine.unload_adapter("all")
    late = engine.submit(prompt, _greedy(), adapter="ours")  # the adapter loaded mid-stream
    late.wait_completion(timeout=60)
    _assert_exact(late.token_ids, late.logprobs, reference("ours", prompt), "ours")

    # a queued (not yet running) request holds its adapter too
    engine.stop()
    queued = engine.submit(prompt, _greedy(), adapter="ours")
    with pytest.raises(AdapterInUse, match="'ours'"):
        engine.unload_adapter("ours")
    engine.start()
    queued.wait_completion(timeout=60)
    _assert_exact(queued.token_ids, queued.logprobs, reference("ours", prompt), "queued")
    engine.unload_adapter("ours")
    engine.unload_adapter("qv")
    assert engine.list_adapters() == []
    with pytest.raises(AdapterNotFound, match="'qv'"):
        engine.submit(prompt, _greedy(), adapter="qv")


# ---------------------------------------------------------------------- 5. LRU of slots
def test_slots_evict_the_least_recently_used_idle_adapter(make_engine, tokenizer, reference):
    engine = make_engine(load=ADAPTERS, lora={"max_loras": 2, "max_lora_rank": 16})
    prompts = [tokenizer.encode(t) for t in TEXTS[:2]]
    expected_slots = [
        ("qv", ["qv", None]),
        ("all", ["qv", "all"]),
        ("ours", ["ours", "all"]),  # qv: least recently used
        ("all", ["ours", "all"]),  # already in a slot: nothing moves
        (None, ["ours", "all"]),  # the base needs no slot
        ("qv", ["qv", "all"]),  # ours (3rd call) is older than all (4th): qv replaces it
    ]
    for adapter, names in expected_slots:
        out = engine.run_batch(prompts, _greedy(), return_logprobs=True, adapter=adapter)
        for prompt, (ids, lps) in zip(prompts, out):
            _assert_exact(ids, lps, reference(adapter, prompt), f"{adapter}")
        assert _slot_names(engine) == names, f"after {adapter}"
        assert engine.adapters.slots.users == [0, 0]
