"""Streamed text reaches asyncio with one wake-up per event loop per engine step
(astrai/inference/handoff.py), in order, and the texts equal the engine's blocking path."""

from __future__ import annotations

import asyncio

import pytest

from astrai.inference import InferenceEngine
from astrai.inference.handoff import Handoff


class _RecordingLoop:
    """Stands in for an event loop: records each wake-up and runs it at once."""

    def __init__(self, closed: bool = False) -> None:
        self.wakeups = 0
        self.closed = closed

    def call_soon_threadsafe(self, fn, *args):
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.wakeups += 1
        fn(*args)


def test_a_step_delivers_once_per_loop_in_order():
    handoff, got = Handoff(), []
    a, b = _RecordingLoop(), _RecordingLoop()
    handoff.post(a, got.append, "first")  # outside a step: at once
    assert got == ["first"] and a.wakeups == 1
    handoff.begin_step()
    for i in range(5):
        handoff.post(a, got.append, f"a{i}")
        handoff.post(b, got.append, f"b{i}")
    assert got == ["first"]  # nothing leaves before the step ends
    handoff.end_step()
    assert (a.wakeups, b.wakeups) == (2, 1)
    assert [x for x in got if x.startswith("a")] == [f"a{i}" for i in range(5)]
    assert [x for x in got if x.startswith("b")] == [f"b{i}" for i in range(5)]
    handoff.begin_step()
    handoff.end_step()  # an empty step wakes nobody
    assert (a.wakeups, b.wakeups) == (2, 1)


def test_a_closed_loop_is_skipped():
    handoff, got = Handoff(), []
    gone, live = _RecordingLoop(closed=True), _RecordingLoop()
    handoff.post(gone, got.append, "lost")  # no raise on the caller's (engine's) thread
    handoff.begin_step()
    handoff.post(gone, got.append, "lost")
    handoff.post(live, got.append, "kept")
    handoff.end_step()
    assert got == ["kept"]


def test_streams_wake_the_loop_per_step_not_per_token(model, tokenizer):
    """8 concurrent streams of 12 tokens: the event loop is woken about once per engine step
    (plus the streams' starts and ends), not once per token per stream, and every stream's
    text equals the blocking call's."""
    prompts = ["import os", "class A:", "def f(x):", "x = 1", "for i in", "# a", "y =", "if x"]
    kw = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    with InferenceEngine(model, tokenizer, max_batch_size=8) as eng:
        expected = eng.generate(prompts, **kw)
        steps_before = eng.get_stats().get("steps")

        async def run():
            loop = asyncio.get_running_loop()
            counted = {"n": 0}
            original = loop.call_soon_threadsafe

            def counting(fn, *args, **kwargs):
                counted["n"] += 1
                return original(fn, *args, **kwargs)

            loop.call_soon_threadsafe = counting

            async def one(p):
                return "".join([t async for t in eng.generate_async(p, **kw)])

            texts = await asyncio.gather(*(one(p) for p in prompts))
            return texts, counted["n"]

        texts, wakeups = asyncio.run(run())
    assert texts == expected
    tokens = len(prompts) * kw["max_tokens"]
    assert wakeups < tokens / 2, (wakeups, tokens, steps_before)


def test_an_interval_holds_routine_steps_but_not_urgent_ones():
    handoff, got = Handoff(interval=60.0), []
    loop = _RecordingLoop()
    handoff.begin_step()
    handoff.post(loop, got.append, "first token")
    handoff.end_step(urgent=True)  # a request started: at once
    assert got == ["first token"] and loop.wakeups == 1
    for i in range(3):
        handoff.begin_step()
        handoff.post(loop, got.append, f"t{i}")
        handoff.end_step(urgent=False)  # within the interval: held
    assert got == ["first token"] and loop.wakeups == 1
    handoff.post(loop, got.append, "outside a step")  # goes after what is held, in one wake-up
    assert got == ["first token", "t0", "t1", "t2", "outside a step"] and loop.wakeups == 2
    handoff.begin_step()
    handoff.post(loop, got.append, "t3")
    handoff.end_step(urgent=False)
    handoff.begin_step()
    handoff.flush()  # inside a step: the step's end decides
    assert got[-1] == "outside a step"
    handoff.end_step(urgent=False)
    handoff.flush()  # the engine went idle: nothing stays held
    assert got[-1] == "t3" and loop.wakeups == 3


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="stream_interval"):
        Handoff(interval=-1.0)


@pytest.mark.parametrize("interval", [0.0, 60.0])
def test_first_tokens_and_ends_are_never_held(model, tokenizer, interval):
    """With a one-minute interval a stream's items are delivered at its first token and at
    its end only, and its text is whole; with none, about once per step.

    Each item carries the output length at the moment it was posted, and items are grouped
    by the delivery (one wake-up call) that carried them: the test drives the steps and a
    recording loop runs each delivery at once, so how late a loaded machine wakes a real
    event loop (several deliveries run in one turn) cannot change what is measured."""
    kw = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    eng = InferenceEngine(model, tokenizer, max_batch_size=4, stream_interval=interval, start=False)
    with eng:
        loop, wakeups = _RecordingLoop(), []  # per delivery: output lengths when posted

        def woken(posted: int, finished: bool) -> None:
            if loop.wakeups > len(wakeups):  # the first item of a new delivery
                wakeups.append([])
            wakeups[-1].append(posted)

        result = eng.submit("import os", **kw)
        result.listen(
            lambda: eng.handoff.post(loop, woken, len(result.task.output_ids), result.done)
        )
        while not result.done:  # steps driven here: nothing races the listener
            eng.step()
        text = result.text
        eng.start()
        expected = eng.generate("import os", **kw)
    assert text == expected
    assert wakeups and wakeups[0] == [1], wakeups  # the first token was not held
    assert max(wakeups[-1]) == kw["max_tokens"], wakeups  # the end was delivered
    if interval:
        assert len(wakeups) <= 3, wakeups  # everything between was held for the end
    else:
        assert len(wakeups) >= kw["max_tokens"] // 2, wakeups
