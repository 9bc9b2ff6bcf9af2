"""`astrai.inference.step_output.StepOutput`: per-row emitted lists, read by name."""

from astrai.inference.step_output import StepOutput


def test_plain_step_accepts_nothing():
    out = StepOutput([[4], [5]], [[-0.1], [-0.2]])
    assert out.proposed is None and [out.accepted(s) for s in range(2)] == [0, 0]
    assert out.faults == {} and out.stopped == set() and out.top_logprobs is None


def test_accepted_is_all_emitted_tokens_but_the_last():
    out = StepOutput([[1, 2, 3], [4], [], [5, 6]], [[0.0] * 3, [0.0], [], [0.0] * 2])
    out.proposed = [4, 2, 3, 0]
    assert [out.accepted(s) for s in range(4)] == [2, 0, 0, 0]


def test_fields_have_their_own_defaults():
    a, b = StepOutput(), StepOutput()
    a.faults[0] = "x"
    a.stopped.add(1)
    assert b.faults == {} and b.stopped == set()
