"""The engine's loop thread records tokens; readers decode them (astrai/inference/result.py).

Incremental detokenization used to run on the loop thread, the scheduler's critical path.
Now `generate_async`, `generate(..., stream=True)` and `wait_completion` decode on the
reader's thread; `subscribe` still decodes on the loop thread (its callbacks take text)."""

from __future__ import annotations

import asyncio
import threading

from astrai.inference import InferenceEngine
from astrai.inference.result import GenerateResult
from astrai.inference.task import Task

KW = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = ["import os", "class A:", "def f(x):", "x = 1"]


def _expected(tokenizer, results):
    return [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]


def test_async_streams_decode_on_the_event_loop_not_the_engine(model, tokenizer, decoding_threads):
    with InferenceEngine(model, tokenizer, max_batch_size=4) as eng:

        async def run():
            async def one(p):
                return "".join([t async for t in eng.generate_async(p, **KW)])

            return await asyncio.gather(*(one(p) for p in PROMPTS))

        texts = asyncio.run(run())
        reference = eng.run_batch([eng.encode(p) for p in PROMPTS], **KW)
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in reference]
    assert decoding_threads == {threading.current_thread().name}


def test_blocking_and_iterating_readers_decode_on_their_own_thread(
    model, tokenizer, decoding_threads
):
    with InferenceEngine(model, tokenizer, max_batch_size=4) as eng:
        texts = eng.generate(PROMPTS, **KW)
        pairs = list(eng.generate(PROMPTS, stream=True, **KW))
        single = "".join(eng.generate(PROMPTS[0], stream=True, **KW))
    streamed = ["".join(t for i, t in pairs if i == k) for k in range(len(PROMPTS))]
    assert streamed == texts and single == texts[0]
    assert decoding_threads == {threading.current_thread().name}


def test_subscribers_are_fed_text_on_the_engine_thread(model, tokenizer, decoding_threads):
    """The contrast: `subscribe` hands text to callbacks, so the loop thread decodes."""
    with InferenceEngine(model, tokenizer, max_batch_size=4, start=False) as eng:
        results = [eng.submit(p, **KW) for p in PROMPTS]
        got: dict[int, list[str]] = {r.id: [] for r in results}
        for r in results:
            r.subscribe(got[r.id].append, lambda _: None)
        eng.start()
        for r in results:
            r.wait_completion(timeout=60)
    assert ["".join(got[r.id]) for r in results] == _expected(tokenizer, results)
    assert "astrai-engine" in decoding_threads


def test_take_pairs_each_piece_with_the_tokens_it_completes(tokenizer):
    """A character split over several byte-level tokens comes out once complete, with the
    count of the token that completed it; the pieces add up to `decode(ids)`."""
    ids = tokenizer.encode("x = 'é€😀' + y", add_special_tokens=False)
    task = Task(prompt_ids=[1])
    result = GenerateResult(task, tokenizer)
    start, pieces = 0, []
    for k, tok in enumerate(ids, 1):
        task.output_ids.append(tok)
        result.on_token(task, tok, 0.0)
        new, start, done = result.take(start)
        assert not done and all(end == k for _, end in new)  # at most this token's text
        pieces += new
    result.on_finish(task)
    new, start, done = result.take(start)
    pieces += new
    assert done and result.done
    assert "".join(t for t, _ in pieces) == tokenizer.decode(ids) == result.text
    assert [end for _, end in pieces] == sorted(end for _, end in pieces)
    assert len(pieces) < len(ids)  # the multi-byte characters waited for their last byte
    assert result.take(start) == ([], start, True)  # nothing twice


def test_wait_reports_new_tokens_then_none(tokenizer):
    task = Task(prompt_ids=[1])
    result = GenerateResult(task, tokenizer)
    assert not result.wait(timeout=0)
    task.output_ids.append(5)
    result.on_token(task, 5, 0.0)
    assert result.wait(timeout=0) and not result.wait(timeout=0)
    result.on_finish(task)
    assert result.wait(timeout=0) and result.done
