"""`InferenceEngine(batch_invariant=True)`: a request's token ids and log-probs do not depend
on what else runs in the engine's steps. The reference is the same request run alone (its
prompt the only one, with the seed it had in the batch): GRPO's colocated rollout of all
groups in one `run_batch` must equal each group sent alone to a server replica, bit for bit
(`==` on lists of floats, `torch.equal`-strict). Same device, dtype and torch thread count in
both runs (docs/inference.md, "Batch invariance")."""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from tiny_parts import TINY_SHAPE

from astrai.extension import attn_backend
from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.engine_options import check_engine_blocks
from astrai.model import LoRAConfig, ModelConfig, Transformer, inject_lora, preset_model

N = 4
SEED = 123
# different lengths: 1 token, under a 16-row block, over it, several prefill chunks
LENGTHS = (5, 17, 1, 40, 9, 23)
PARAMS = SamplingParams(
    max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, n=N, logprobs_mode="scaled"
)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _engine(model, tokenizer, **kw) -> InferenceEngine:
    options = dict(cache_mode="paged", max_prefill_tokens=16, max_batch_size=32, start=False)
    return InferenceEngine(model, tokenizer, **{**options, **kw})


def _rows(results) -> list[tuple[list[int], list[float]]]:
    return [(list(r.token_ids), list(r.logprobs)) for r in results]


def _batch_and_alone(engine, prompts, params=PARAMS):
    together = _rows(engine.run_batch(prompts, params, seed=SEED, return_details=True))
    alone = []
    for i, prompt in enumerate(prompts):
        alone += _rows(engine.run_batch([prompt], params, seed=SEED + i * N, return_details=True))
    return together, alone


@pytest.mark.parametrize("cache_mode", ["paged", "contiguous"])
def test_run_batch_equals_each_prompt_alone(model, tokenizer, cache_mode):
    prompts = _prompts(len(tokenizer))
    with _engine(model, tokenizer, cache_mode=cache_mode, batch_invariant=True) as engine:
        together, alone = _batch_and_alone(engine, prompts)
    assert len(together) == len(prompts) * N
    assert all(len(ids) == len(lps) > 0 for ids, lps in together)
    for i, (a, b) in enumerate(zip(together, alone)):
        assert a[0] == b[0], f"result {i}: token ids differ"
        assert a[1] == b[1], f"result {i}: log-probs differ"


def test_two_threads_keep_it(model, tokenizer):
    """The guarantee holds at any one thread count (2 here); across thread counts it is not
    claimed (a kernel may split its work differently)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with _engine(model, tokenizer, batch_invariant=True) as engine:
            together, alone = _batch_and_alone(engine, _prompts(len(tokenizer)))
    finally:
        torch.set_num_threads(before)
    assert together == alone


def test_without_it_the_batch_can_change_log_probs(model, tokenizer):
    """Why the option exists: off, some row's log-probs differ between the batch and alone
    (the products' bits depend on their row count). Where this CPU's kernels happen to be
    row-invariant for these shapes there is nothing to show, and the test says so."""
    with _engine(model, tokenizer) as engine:
        together, alone = _batch_and_alone(engine, _prompts(len(tokenizer)))
    if together == alone:
        pytest.skip("this CPU's kernels gave row-invariant results without the mode")
    assert any(a[1] != b[1] for a, b in zip(together, alone))


# per group: sampling settings of its own, so a step's rows mix stages some rows skip
MIXED = [
    {},
    {"top_p": 1.0, "top_k": 0},
    {"min_p": 0.05, "presence_penalty": 0.5},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 0.0},
    {"frequency_penalty": 0.3, "top_p": 0.8},
]


def test_concurrent_submissions_to_the_loop_equal_each_alone(model, tokenizer):
    """Groups submitted at once from several threads to the running loop (the HTTP server's
    way), each with its own sampling settings, batch continuously with one another; each
    equals its group run alone."""
    prompts = _prompts(len(tokenizer))
    params = [dataclasses.replace(PARAMS, **MIXED[i]) for i in range(len(prompts))]
    with _engine(model, tokenizer, batch_invariant=True, start=True) as engine:
        groups: dict[int, list] = {}
        barrier = threading.Barrier(len(prompts))

        def submit(i: int) -> None:
            barrier.wait()
            groups[i] = engine.submit_group(prompts[i], params[i], seed=SEED + i * N)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for group in groups.values():
            for r in group:
                r.wait_completion()
        shared_steps = engine.get_stats()["steps"]
        engine.stop()
        concurrent = [row for i in range(len(prompts)) for row in _rows(groups[i])]
        alone = []
        for i, prompt in enumerate(prompts):
            results = engine.run_batch([prompt], params[i], seed=SEED + i * N, return_details=True)
            alone += _rows(results)
        alone_steps = engine.get_stats()["steps"] - shared_steps
    assert shared_steps < alone_steps  # the groups did share steps
    assert concurrent == alone


def test_a_live_lora_adapter_keeps_it(tokenizer):
    """A training run's adapter (GRPO with LoRA) is served from the engine's slots; its
    deltas are invariant too."""
    cfg = ModelConfig(vocab_size=len(tokenizer), max_position_embeddings=512, **TINY_SHAPE)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    inject_lora(
        model, LoRAConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    with _engine(model, tokenizer, batch_invariant=True) as engine:
        assert engine.lora_enabled
        together, alone = _batch_and_alone(engine, _prompts(len(tokenizer)))
    assert together == alone


def test_prefix_cache_null_resolves_to_off_and_groups_still_run(model, tokenizer):
    with _engine(model, tokenizer, batch_invariant=True) as engine:
        assert not engine.pool.shares_prefixes
        out = engine.run_batch([[5, 6, 7, 8] * 10], PARAMS, seed=1, return_details=True)
    assert len(out) == N and all(r.finish_reason == "length" for r in out)
    # samples of one prompt differ by their seeds only
    assert len({tuple(r.token_ids) for r in out}) > 1


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"prefix_cache": True}, "prefix_cache"),
        ({"speculative": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"decode_graphs": "stand-in"}, "decode_graphs"),
    ],
)
def test_settings_that_break_it_are_refused_naming_both_keys(model, tokenizer, setting, named):
    with pytest.raises(ValueError) as err:
        _engine(model, tokenizer, batch_invariant=True, **setting)
    assert "batch_invariant=true" in str(err.value) and named in str(err.value)
    with pytest.raises(SystemExit) as exit_:
        check_engine_blocks({"batch_invariant": True, **setting})
    assert "engine.batch_invariant" in str(exit_.value) and f"engine.{named}" in str(exit_.value)


def test_a_non_bool_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="batch_invariant must be true or false"):
        _engine(model, tokenizer, batch_invariant="yes")


def test_another_attention_backend_is_refused_per_request(model, tokenizer):
    """Only torch_native's per-request path is invariant: a request whose submitter chose
    another backend ends `aborted` saying so (the others are unaffected)."""
    with _engine(model, tokenizer, batch_invariant=True) as engine:
        with attn_backend("flash"):
            out = engine.run_batch([[5, 6, 7]], max_tokens=2, return_details=True)
        fine = engine.run_batch([[5, 6, 7]], max_tokens=2, ignore_eos=True, return_details=True)
    assert out[0].finish_reason == "aborted" and "batch_invariant" in out[0].error
    assert fine[0].finish_reason == "length"


def test_the_serve_config_accepts_the_key(model, tokenizer):
    """`python -m astrai.serve engine.batch_invariant=true`: composed, checked as serve
    checks it, and built by the engine factory of conf/engine."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("serve", overrides=["engine.batch_invariant=true"])
    engine_cfg = OmegaConf.to_container(cfg.engine, resolve=True)
    assert engine_cfg["batch_invariant"] is True
    check_engine_blocks(engine_cfg)
    factory = instantiate(copy.deepcopy(engine_cfg))
    with factory(model, tokenizer, start=False, kv_tokens=2048) as engine:
        assert engine.batch_invariant and not engine.pool.shares_prefixes


def test_greedy_in_the_mode_is_the_dense_forwards_greedy(model, tokenizer, greedy_reference):
    """Invariant, and still right: greedy tokens of a batch equal those of the training
    forward recomputing the whole sequence (an independent reference)."""
    prompts = _prompts(len(tokenizer))
    with _engine(model, tokenizer, batch_invariant=True) as engine:
        got = engine.run_batch(prompts, max_tokens=8, temperature=0.0)
    assert got == [greedy_reference(model, p, 8) for p in prompts]


def test_a_short_kv_pool_queues_requests_instead_of_preempting_them(model, tokenizer):
    """Off, a pool too small for the batch preempts (recomputing a request's KV by prefill,
    other bits than its decode steps gave); on, each request's whole context is reserved at
    admission, so the others wait instead and the results stay those of each prompt alone."""
    prompts = _prompts(len(tokenizer))
    params = dataclasses.replace(PARAMS, max_tokens=30, ignore_eos=True)
    short = dict(kv_tokens=240, page_size=4)
    with _engine(model, tokenizer, **short) as engine:
        engine.run_batch(prompts, params, seed=SEED)
        assert engine.get_stats()["preemptions"] > 0  # the pool is short for this batch
    with _engine(model, tokenizer, **short, batch_invariant=True) as engine:
        together, alone = _batch_and_alone(engine, prompts, params)
        assert engine.get_stats()["preemptions"] == 0
    assert together == alone


# MoE at width 256: there the experts' and router's products depend on their row counts
WIDE_MOE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256)


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny", dict(hidden_size=256, intermediate_size=704)),
        ("tiny-moe", WIDE_MOE),
        ("tiny-mla", {}),
    ],
    ids=["dense-256", "moe-256", "mla"],
)
def test_wider_moe_and_mla_models_keep_it(tokenizer, greedy_reference, preset, overrides):
    """The router's and experts' products run in the same fixed blocks (every batch on the
    sorted path); MLA's absorbed projections too, and its latent attention per request
    (astrai.extension.mla); greedy still equals the dense forward's."""
    torch.manual_seed(0)
    model = preset_model(
        preset, vocab_size=len(tokenizer), max_position_embeddings=512, **overrides
    ).eval()
    prompts = _prompts(len(tokenizer))
    with _engine(model, tokenizer, batch_invariant=True) as engine:
        together, alone = _batch_and_alone(engine, prompts)
        greedy = engine.run_batch(prompts[:3], max_tokens=6, temperature=0.0)
    assert together == alone
    assert greedy == [greedy_reference(model, p, 6) for p in prompts[:3]]


def test_scored_continuations_equal_each_scored_alone(model, tokenizer):
    """Prompt log-probs (`score`, evaluation's log-likelihoods) are computed from the same
    blocked LM head: a request scored beside others equals it scored alone."""
    prompts = _prompts(len(tokenizer))
    requests = [(p, [7, 8, 9, 10][: 1 + i % 4]) for i, p in enumerate(prompts)]
    with _engine(model, tokenizer, batch_invariant=True) as engine:
        together = engine.score(requests, top_logprobs=2)
        alone = [engine.score([r], top_logprobs=2)[0] for r in requests]
    assert [s.logprob for s in together] == [s.logprob for s in alone]
    assert [s.tokens for s in together] == [s.tokens for s in alone]


def test_grpo_rollout_engine_takes_the_key():
    """`strategy.engine.batch_invariant=true`: GRPO's rollout engine factory (conf/engine)
    passes it to the engine."""
    from hydra.utils import instantiate

    from astrai.train.runner import compose

    cfg = compose(
        ["strategy=grpo", "strategy.engine.batch_invariant=true", "paths.output_dir=/tmp/unused"]
    )
    factory = instantiate(cfg.strategy.engine)
    assert factory.func is InferenceEngine and factory.keywords["batch_invariant"] is True


def test_the_kv_layout_and_batch_size_do_not_matter(model, tokenizer):
    """A trainer's rollout engine and a server replica may size their engines differently:
    paged or contiguous, any `max_batch_size`, the same bits (`max_prefill_tokens` does
    matter for prompts longer than it: it sets the chunks)."""
    prompts = _prompts(len(tokenizer))
    runs = []
    for kw in (dict(cache_mode="paged", max_batch_size=64), dict(cache_mode="contiguous")):
        with _engine(model, tokenizer, batch_invariant=True, **kw) as engine:
            runs.append(_rows(engine.run_batch(prompts, PARAMS, seed=SEED, return_details=True)))
    assert runs[0] == runs[1]
