"""Engine sleep (`astrai.inference.sleep`): a sleeping engine gives back its KV pool and packs
and, woken, generates exactly what an engine that never slept generates."""

import random

import pytest
import torch
from tiny_parts import tiny_transformer

from astrai.inference import EngineNotReady, InferenceEngine
from astrai.inference.engine import EngineSleeping
from astrai.inference.engine_options import check_engine_blocks
from astrai.model.layers import Attention
from astrai.model.packed import pack_projections, release_projections


@pytest.fixture
def model(tokenizer):
    """A model of this test's own: the packs' holders are counted per model, and the
    session's shared one may still carry another file's engine (xdist runs files together)."""
    return tiny_transformer(len(tokenizer))


MODES = {
    "contiguous": dict(cache_mode="contiguous"),
    "paged-radix": dict(cache_mode="paged", page_size=4, kv_tokens=2048),
}


def prompts(n: int, seed: int = 0, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(9)]  # a common prefix: the radix cache hits
    return [shared + [rng.randrange(vocab) for _ in range(rng.randint(2, 20))] for _ in range(n)]


def engine(model, tokenizer, mode: str, **kw) -> InferenceEngine:
    return InferenceEngine(
        model,
        tokenizer,
        start=False,
        max_batch_size=4,
        max_seq_len=64,
        **{"enable_sleep_mode": True, **MODES[mode], **kw},
    )


def rollouts(eng: InferenceEngine, cycle: int) -> list:
    ps = prompts(5, seed=cycle)
    greedy = eng.run_batch(ps, max_tokens=8, temperature=0.0, ignore_eos=True)
    sampled = eng.run_batch(
        ps, max_tokens=8, temperature=1.0, seed=11 + cycle, n=2, return_logprobs=True
    )
    return [greedy, sampled]


def packs_of(model) -> list:
    return [m.packed_qkv for m in model.modules() if type(m) is Attention]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_slept_engine_rolls_out_what_a_never_slept_one_does(model, tokenizer, mode):
    with engine(model, tokenizer, mode) as awake:
        expected = [rollouts(awake, cycle) for cycle in range(3)]
    with engine(model, tokenizer, mode) as sleeper:
        size = sleeper.get_stats()["kv_allocated_bytes"]
        buffers = (sleeper.pool.k_buffer, sleeper.pool.v_buffer)
        assert size == sum(b.numel() * b.element_size() for b in buffers) > 0
        got = []
        for cycle in range(3):
            got.append(rollouts(sleeper, cycle))
            sleeper.sleep(level=1)
            stats = sleeper.get_stats()
            assert sleeper.is_sleeping and stats["is_sleeping"]
            assert stats["kv_allocated_bytes"] == 0 and stats["sleep_count"] == cycle + 1
            assert sleeper.pool.cached_tokens == 0  # the prefix cache forgot the dead pages
            assert all(p is None for p in packs_of(model))  # the packs are gone
            sleeper.wake_up()
            assert not sleeper.is_sleeping
            assert sleeper.get_stats()["kv_allocated_bytes"] == size  # the same pool again
            assert all(p is not None for p in packs_of(model))
    assert got == expected


def test_packs_are_rebuilt_from_the_weights_of_the_wake_up(model, tokenizer):
    """Weights that change while asleep (an optimizer step) are what the woken engine uses."""
    changed = type(model)(model.config)
    changed.load_state_dict(model.state_dict())
    with engine(changed, tokenizer, "contiguous") as eng:
        ps = prompts(3, seed=5)
        eng.sleep()
        with torch.no_grad():
            for p in changed.parameters():
                p.mul_(0.9)
        eng.update_weights(version=1)  # allowed asleep: no KV involved
        eng.wake_up()
        got = eng.run_batch(ps, max_tokens=6, temperature=0.0, ignore_eos=True)
    with engine(changed, tokenizer, "contiguous", packed_projections=False) as plain:
        assert got == plain.run_batch(ps, max_tokens=6, temperature=0.0, ignore_eos=True)


def test_another_engines_packs_survive_a_sleep(model, tokenizer):
    pack_projections(model, None)  # another user of the model's packs
    try:
        with engine(model, tokenizer, "contiguous") as eng:
            eng.sleep()
            assert all(p is not None for p in packs_of(model))
            eng.wake_up()
            eng.sleep()
        assert all(p is not None for p in packs_of(model))  # shutdown asleep: not twice
        eng.wake_up()  # shut down: nothing taken back
        assert eng.get_stats()["kv_allocated_bytes"] == 0
        with pytest.raises(EngineNotReady, match="shut down"):
            eng.sleep()
    finally:
        release_projections(model)
    assert all(p is None for p in packs_of(model))


def test_calls_while_asleep(model, tokenizer):
    """run_batch / score refuse; submit queues and runs after the wake-up."""
    ps = prompts(2, seed=3)
    with engine(model, tokenizer, "paged-radix") as ref:
        expected = ref.run_batch(ps[:1], max_tokens=5, temperature=0.0, ignore_eos=True)
    with engine(model, tokenizer, "paged-radix") as eng:
        eng.start()
        eng.sleep()
        assert not eng.running and not eng.ready
        with pytest.raises(EngineSleeping, match="wake_up"):
            eng.run_batch(ps, max_tokens=4)
        with pytest.raises(EngineNotReady, match="wake_up"):
            eng.score([(ps[0], [1, 2])])
        queued = eng.submit(ps[0], max_tokens=5, temperature=0.0, ignore_eos=True)
        eng.stop()
        eng.start()  # a start while asleep waits for the wake-up
        assert not eng.running and not queued.done
        eng.wake_up()
        assert eng.running
        queued.wait_completion(timeout=120)
        assert [queued.token_ids] == expected
        eng.sleep()
        eng.sleep()  # a second sleep does nothing
        assert eng.get_stats()["sleep_count"] == 2
        eng.wake_up()
        eng.wake_up()  # awake: nothing


def test_sleep_waits_for_requests_holding_kv(model, tokenizer):
    with engine(model, tokenizer, "contiguous") as eng:
        result = eng.submit(prompts(1)[0], max_tokens=4, temperature=0.0)
        assert eng.scheduler.has_work()
        eng.step()  # admitted: the request holds KV, and no loop will finish it
        with pytest.raises(RuntimeError, match="hold KV"):
            eng.sleep()
        assert not eng.is_sleeping and eng.get_stats()["kv_allocated_bytes"] > 0
        eng.start()
        result.wait_completion(timeout=120)
        eng.sleep()  # the loop finishes what it has, then sleeps
        assert eng.is_sleeping


def test_bad_sleep_settings_are_refused_naming_the_key(model, tokenizer):
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        InferenceEngine(model, tokenizer, start=False, enable_sleep_mode="yes")
    with pytest.raises(SystemExit, match=r"engine\.enable_sleep_mode"):
        check_engine_blocks({"enable_sleep_mode": "yes"})
    check_engine_blocks({"enable_sleep_mode": True})
    off = InferenceEngine(model, tokenizer, start=False, max_seq_len=32)
    with off, pytest.raises(RuntimeError, match="enable_sleep_mode"):
        off.sleep()
    with engine(model, tokenizer, "contiguous") as eng:
        with pytest.raises(ValueError, match="level"):
            eng.sleep(level=2)
        assert not eng.is_sleeping


def test_a_draft_models_kv_sleeps_too(model, tokenizer, tmp_path):
    """Speculative decoding with a draft model: its KV pool is freed and taken back as well,
    and the woken engine proposes and accepts what a never-slept one does."""
    from astrai.model import save_pretrained

    save_pretrained(model, tmp_path)  # the target as its own draft
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    ps = prompts(3, seed=7)
    with engine(model, tokenizer, "contiguous", speculative=spec) as ref:
        expected = ref.run_batch(ps, max_tokens=9, temperature=0.0, ignore_eos=True)
    with engine(model, tokenizer, "contiguous", speculative=spec) as eng:
        (draft,) = eng.proposer.kv_pools
        size = draft.kv_allocated_bytes
        eng.sleep()
        assert draft.kv_allocated_bytes == 0 and draft.released
        eng.wake_up()
        assert draft.kv_allocated_bytes == size and not draft.released
        got = eng.run_batch(ps, max_tokens=9, temperature=0.0, ignore_eos=True)
        assert eng.get_stats()["spec_accepted_tokens"] > 0
    assert got == expected


def test_metrics_show_the_sleep(model, tokenizer):
    """`/metrics` (astrai.serve.metrics) exposes the pool's bytes and the sleep."""
    from astrai.serve.metrics import EngineCollector

    def gauges(eng: InferenceEngine) -> dict[str, float]:
        return {m.name: m.samples[0].value for m in EngineCollector(eng).collect() if m.samples}

    with engine(model, tokenizer, "contiguous") as eng:
        awake = gauges(eng)
        eng.sleep()
        asleep = gauges(eng)
    assert awake["astrai_kv_cache_allocated_bytes"] == eng.pool.storage.nbytes[0] * 2
    assert awake["astrai_engine_sleeping"] == 0
    assert asleep["astrai_kv_cache_allocated_bytes"] == 0 and asleep["astrai_engine_sleeping"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(MODES))
def test_on_cuda_the_graphs_are_captured_again_and_the_memory_given_back(model, tokenizer, mode):
    """CUDA graphs hold the addresses of the pool and the packs: the woken engine captures them
    again and decodes what a never-slept one does; asleep, the device holds less by the pool."""
    gpu_model = type(model)(model.config).to("cuda")
    gpu_model.load_state_dict(model.state_dict())
    with engine(gpu_model, tokenizer, mode) as awake:
        assert awake.cuda_graph_enabled
        expected = [rollouts(awake, cycle) for cycle in range(2)]
    with engine(gpu_model, tokenizer, mode) as sleeper:
        got = []
        for cycle in range(2):
            got.append(rollouts(sleeper, cycle))
            torch.cuda.synchronize()
            held = torch.cuda.memory_reserved()
            sleeper.sleep()
            assert sleeper.graph_runner is None
            kv = sum(sleeper.pool.storage.nbytes)
            assert torch.cuda.memory_reserved() <= held - kv  # handed back, not cached
            sleeper.wake_up()
            assert sleeper.cuda_graph_enabled

    def tokens(runs: list) -> list:
        return [[greedy, [ids for ids, _ in sampled]] for greedy, sampled in runs]

    assert tokens(got) == tokens(expected)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("sleep_mode", [False, True])
def test_shutdown_gives_the_kv_pool_back(model, tokenizer, mode, sleep_mode):
    # An engine built after another finds the memory free (on a GPU the engine benchmark's
    # fourth engine, each pool sized from free memory, ran out of memory without this).
    eng = engine(model, tokenizer, mode, enable_sleep_mode=sleep_mode)
    eng.run_batch(prompts(3), max_tokens=4, temperature=0.0)
    assert eng.get_stats()["kv_allocated_bytes"] > 0
    eng.shutdown()
    assert eng.get_stats()["kv_allocated_bytes"] == 0
    assert eng.pool.k_buffer.untyped_storage().nbytes() == 0
    eng.shutdown()  # a second shutdown changes nothing
