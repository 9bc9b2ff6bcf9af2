"""Speculative decoding with a draft model (`astrai.inference.draft`): the output is the
target's, token for token, whatever the draft proposes; the draft's KV follows the request."""

import random

import pytest
import torch

from astrai.inference import InferenceEngine, Task
from astrai.inference.draft import DraftModelProposer
from astrai.inference.speculative import SpeculativeConfig
from astrai.inference.task import TaskState
from astrai.model import ModelConfig, Transformer, save_pretrained

K = 3
MODES = {
    "contiguous": dict(cache_mode="contiguous"),
    "paged-4-radix": dict(cache_mode="paged", page_size=4, kv_tokens=4096),
}


@pytest.fixture(scope="module")
def copy_dir(model, tmp_path_factory):
    """The target itself as the draft: every greedy proposal is accepted."""
    path = tmp_path_factory.mktemp("draft-copy")
    save_pretrained(model, path)
    return str(path)


def small_model(vocab_size: int, seed: int = 1, **overrides) -> Transformer:
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.15,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**cfg)).eval()


@pytest.fixture(scope="module")
def small_dir(model, tmp_path_factory):
    """An unrelated, smaller random draft (hidden 32, one layer): few proposals accepted."""
    path = tmp_path_factory.mktemp("draft-small")
    save_pretrained(small_model(model.config.vocab_size), path)
    return str(path)


def prompts(n: int, seed: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(384) for _ in range(prefix)]
    return [shared + [rng.randrange(384) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def spec(path: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def run(model, tokenizer, batches, speculative=None, mode="contiguous", **sampling):
    """Each batch of `batches` through one engine, in turn; (outputs, stats, engine)."""
    kw = dict(max_tokens=11, temperature=0.0, ignore_eos=True, return_details=True)
    kw.update(sampling)
    with InferenceEngine(
        model,
        tokenizer,
        max_batch_size=8,
        max_seq_len=128,
        start=False,
        speculative=speculative,
        **MODES[mode],
    ) as eng:
        out = [eng.run_batch(b, **kw) for b in batches]
        stats = eng.get_stats()
        assert eng.pool.used_tokens == 0 and eng.pool.all_free()
    if speculative is not None:
        assert eng.proposer.rows_in_use == 0 and eng.proposer.pool.all_free()
    return [[(r.token_ids, r.finish_reason) for r in b] for b in out], stats, eng


def batches_for(mode: str) -> list[list[list[int]]]:
    if mode == "contiguous":
        return [prompts(5, seed=0)]
    # a shared prefix: the second batch's prompts hit the first's cached pages
    ps = prompts(5, seed=1, prefix=24)
    return [ps[:1], ps[1:]]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_copy_draft_accepts_everything_and_changes_nothing(
    model, tokenizer, copy_dir, mode, greedy_reference
):
    batches = batches_for(mode)
    plain, _, _ = run(model, tokenizer, batches, mode=mode)
    fast, stats, _ = run(model, tokenizer, batches, spec(copy_dir), mode=mode)
    assert fast == plain
    for batch, outs in zip(batches, fast):
        for p, (ids, reason) in zip(batch, outs):
            assert ids == greedy_reference(model, p, 11)  # max_tokens reached mid-proposal
            assert reason == "length"
    assert stats["spec_draft_tokens"] > 0
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
    assert stats["spec_mean_accepted_length"] > 2
    if mode != "contiguous":
        assert stats["cached_prompt_tokens"] > 0


@pytest.mark.parametrize("mode", sorted(MODES))
def test_small_random_draft_changes_nothing(model, tokenizer, small_dir, mode):
    batches = batches_for(mode)
    plain, _, _ = run(model, tokenizer, batches, mode=mode, max_tokens=16)
    fast, stats, _ = run(model, tokenizer, batches, spec(small_dir), mode=mode, max_tokens=16)
    assert fast == plain
    assert stats["spec_num_drafts"] > 0
    assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


@pytest.mark.parametrize(("draft", "temperature"), [("copy", 1.0), ("small", 1.0), ("copy", 0.3)])
def test_seeded_sampling_is_the_same_with_and_without(
    model, tokenizer, copy_dir, small_dir, draft, temperature
):
    path = copy_dir if draft == "copy" else small_dir
    batches = [prompts(4, seed=2)]
    kw = dict(temperature=temperature, seed=11, max_tokens=14)
    plain, _, _ = run(model, tokenizer, batches, **kw)
    fast, stats, _ = run(model, tokenizer, batches, spec(path, k=4), **kw)
    assert fast == plain
    assert stats["spec_num_drafts"] > 0
    if temperature < 1:  # a peaked distribution: the greedy proposals are often sampled
        assert stats["spec_accepted_tokens"] > 0


def test_preempted_requests_keep_their_draft_kv(model, tokenizer, copy_dir, small_dir):
    """A paged pool for about three long requests gets eight: preemption mid-speculation."""
    rng = random.Random(26)
    ps = [[rng.randrange(384) for _ in range(rng.randint(20, 36))] for _ in range(8)]
    pool = dict(cache_mode="paged", page_size=4, kv_tokens=240)

    def go(speculative):
        with InferenceEngine(
            model,
            tokenizer,
            max_batch_size=8,
            max_seq_len=128,
            start=False,
            speculative=speculative,
            **pool,
        ) as eng:
            out = eng.run_batch(ps, max_tokens=40, temperature=0.0, ignore_eos=True)
            stats = eng.get_stats()
            assert eng.pool.all_free()
        return out, stats

    plain, _ = go(None)
    for path in (copy_dir, small_dir):
        fast, stats = go(spec(path))
        assert stats["preemptions"] > 0
        assert fast == plain


def test_rows_are_freed_when_tasks_finish_and_on_close(model, tokenizer, small_dir):
    eng = InferenceEngine(
        model, tokenizer, max_batch_size=4, max_seq_len=64, start=False, speculative=spec(small_dir)
    )
    proposer = eng.proposer
    assert isinstance(proposer, DraftModelProposer)
    assert proposer.pool.max_batch_size == 4 and proposer.pool.max_seq_len == 64
    try:
        eng.run_batch(prompts(4, seed=3), max_tokens=8, temperature=0.0, ignore_eos=True)
        assert eng.get_stats()["kv_used_tokens"] == 0
        # finished requests' rows go back at the next proposal
        eng.run_batch(prompts(1, seed=4), max_tokens=8, temperature=0.0, ignore_eos=True)
        assert proposer.rows_in_use <= 1
        # more requests over time than rows: rows are reused
        for seed in range(5, 9):
            eng.run_batch(prompts(3, seed=seed), max_tokens=6, temperature=0.0, ignore_eos=True)
    finally:
        eng.shutdown()
    assert proposer.rows_in_use == 0 and proposer.pool.all_free()


def test_default_max_seq_len_is_the_engines(model, small_dir):
    cfg = SpeculativeConfig(method="draft_model", model=small_dir)
    proposer = DraftModelProposer(cfg, model, 2, None)
    assert proposer.pool.max_seq_len == min(model.config.max_position_embeddings, 4096)
    assert proposer.pool.max_batch_size == 2
    assert not proposer.model.training


def _dense_greedy(model: Transformer, seq: list[int], n: int) -> list[int]:
    ids = list(seq)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(seq) :]


def test_draft_kv_follows_the_sequence(model, small_dir):
    """Proposals always equal the draft's dense greedy continuation of the sequence, whether
    the target accepted all, some or none of the last ones, and whether `verified` came."""
    cfg = SpeculativeConfig(method="draft_model", model=small_dir, num_speculative_tokens=4)
    proposer = DraftModelProposer(cfg, model, 3, 128)
    draft = proposer.model
    rng = random.Random(5)
    a = Task([rng.randrange(384) for _ in range(17)])
    b = Task([rng.randrange(384) for _ in range(5)])

    def check(tasks, budgets):
        out = proposer.propose(tasks, budgets)
        for t, k, p in zip(tasks, budgets, out):
            assert p == _dense_greedy(draft, t.prompt_ids + t.output_ids, k)
        return out

    pa, pb = check([a, b], [4, 2])
    # a: all 4 accepted plus a bonus token; b: first accepted, then a different token
    a.output_ids += [*pa, 7]
    proposer.verified(a, 4, 4)
    b.output_ids += [pb[0], (pb[1] + 1) % 384]
    proposer.verified(b, 2, 1)
    pa, pb = check([a, b], [3, 4])
    # a: none accepted; b: no verification at all (its step did not speculate)
    a.output_ids.append((pa[0] + 1) % 384)
    proposer.verified(a, 3, 0)
    b.output_ids += [11, 12]
    check([a, b], [1, 3])
    # budget 0: nothing proposed, nothing held for it
    c = Task([1, 2, 3])
    assert proposer.propose([c], [0]) == [[]]
    assert proposer.rows_in_use == 2
    # a finished task's row is freed at the next proposal
    a.state = TaskState.FINISHED
    check([b], [2])
    assert proposer.rows_in_use == 1
    proposer.close()
    assert proposer.rows_in_use == 0 and proposer.pool.all_free()


def test_bad_draft_dir_or_vocab_is_refused(model, tokenizer, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=r"engine\.speculative\.model.*nowhere"):
        InferenceEngine(model, tokenizer, start=False, speculative=spec(str(missing)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"engine\.speculative\.model.*config\.json"):
        InferenceEngine(model, tokenizer, start=False, speculative=spec(str(empty)))
    other = tmp_path / "other-vocab"
    save_pretrained(small_model(model.config.vocab_size + 16), other)
    with pytest.raises(ValueError, match=r"engine\.speculative\.model.*other-vocab.*vocab_size"):
        InferenceEngine(model, tokenizer, start=False, speculative=spec(str(other)))
    with pytest.raises(ValueError, match=r"engine\.speculative\.model"):
        InferenceEngine(model, tokenizer, start=False, speculative={"method": "draft_model"})
