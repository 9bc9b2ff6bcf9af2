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

import pytest
import torch
from peft_adapters import (
    ADAPTERS,
    LONG,
    N_TOKENS,
    TEXTS,
    TOL,
    SlowTransformer,
    assert_exact,
    build_dirs,
    build_reference,
    engine_factory,
    greedy,
    slot_names,
)

from astrai.inference.adapters import AdapterError, AdapterInUse, AdapterNotFound
from astrai.inference.params import SamplingParams


@pytest.fixture(scope="module")
def dirs(tokenizer, tmp_path_factory):
    return build_dirs(tokenizer, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(dirs):
    return build_reference(dirs)


@pytest.fixture
def make_engine(dirs, tokenizer):
    yield from engine_factory(dirs, tokenizer)


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
    results = [engine.submit(p, greedy(logprobs_mode="raw"), adapter=a) for a, p in jobs]
    engine.start()
    for (adapter, prompt), result in zip(jobs, results):
        result.wait_completion(timeout=60)
        assert result.finish_reason == "length", result.task.error
        assert_exact(
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
            assert_exact(ids, lps, reference(adapter, prompt), f"run_batch {adapter}")


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
        (out,) = engine.run_batch([prompt], greedy(), return_details=True, adapter=adapter)
        assert_exact(out.token_ids, out.logprobs, reference(adapter, prompt), str(adapter))
        return out.cached_prompt_tokens

    assert run("qv") == 0
    before = engine.get_stats()["cached_prompt_tokens"]
    assert run("all") == 0, "adapter 'all' was served KV computed under 'qv'"
    assert run(None) == 0, "the base was served KV computed under 'qv'"
    assert engine.get_stats()["cached_prompt_tokens"] == before
    # streamed requests count the same way (GenerateResult's task)
    streamed = engine.submit(prompt, greedy(), adapter="ours")
    streamed.wait_completion(timeout=60)
    assert streamed.task.cached_tokens == 0
    assert_exact(streamed.token_ids, streamed.logprobs, reference("ours", prompt), "ours")

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
        engine.submit(prompt, greedy(), adapter="nope")
    with pytest.raises(AdapterNotFound, match="'nope'"):
        engine.generate(TEXTS[0], greedy(adapter="nope"))
    with pytest.raises(AdapterNotFound, match="'nope'"):
        # one bad prompt's adapter: nothing of the batch runs
        engine.run_batch([prompt, prompt], greedy(), adapter="nope")
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
        engine.submit(tokenizer.encode(TEXTS[0]), greedy(), adapter="qv")
    assert "'qv'" in str(err.value)
    with pytest.raises(AdapterNotFound, match=r"lora="):
        engine.run_batch([tokenizer.encode(TEXTS[0])], greedy(), adapter="qv")
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
    stream = engine.submit(prompt, greedy(max_tokens=n), adapter="qv")
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
    assert_exact(stream.token_ids, stream.logprobs, reference("qv", prompt, n), "qv stream")

    with pytest.raises(AdapterNotFound, match="'all'"):
        engine.submit(prompt, greedy(), adapter="all")
    with pytest.raises(AdapterNotFound):
        engine.unload_adapter("all")
    late = engine.submit(prompt, greedy(), adapter="ours")  # the adapter loaded mid-stream
    late.wait_completion(timeout=60)
    assert_exact(late.token_ids, late.logprobs, reference("ours", prompt), "ours")

    # a queued (not yet running) request holds its adapter too
    engine.stop()
    queued = engine.submit(prompt, greedy(), adapter="ours")
    with pytest.raises(AdapterInUse, match="'ours'"):
        engine.unload_adapter("ours")
    engine.start()
    queued.wait_completion(timeout=60)
    assert_exact(queued.token_ids, queued.logprobs, reference("ours", prompt), "queued")
    engine.unload_adapter("ours")
    engine.unload_adapter("qv")
    assert engine.list_adapters() == []
    with pytest.raises(AdapterNotFound, match="'qv'"):
        engine.submit(prompt, greedy(), adapter="qv")


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
        out = engine.run_batch(prompts, greedy(), return_logprobs=True, adapter=adapter)
        for prompt, (ids, lps) in zip(prompts, out):
            assert_exact(ids, lps, reference(adapter, prompt), f"{adapter}")
        assert slot_names(engine) == names, f"after {adapter}"
        assert engine.adapters.slots.users == [0, 0]
