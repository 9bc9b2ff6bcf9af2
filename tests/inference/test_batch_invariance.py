"""`BatchInvariance`: the `batch_invariant` option checked against what it cannot run with,
and the settings the engine builds with (the engine itself: test_batch_invariant.py)."""

from __future__ import annotations

import pytest

from astrai.inference.batch_invariance import BatchInvariance


def test_off_leaves_every_setting_as_given():
    got = BatchInvariance.check(False, prefix_cache=True, decode_graphs="stand-in")
    assert got == BatchInvariance(False, True, "stand-in")


@pytest.mark.parametrize("prefix_cache", [None, False])
@pytest.mark.parametrize("decode_graphs", [None, False])
def test_on_turns_the_automatic_prefix_cache_and_graphs_off(prefix_cache, decode_graphs):
    got = BatchInvariance.check(True, prefix_cache=prefix_cache, decode_graphs=decode_graphs)
    assert got == BatchInvariance(True, False, False)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ({"prefix_cache": True}, "engine.prefix_cache=true"),
        ({"decode_graphs": True}, "engine.decode_graphs=True"),
        ({"speculative": {"method": "ngram"}}, "engine.speculative"),
    ],
)
def test_a_conflict_names_both_keys(setting, named):
    with pytest.raises(ValueError) as err:
        BatchInvariance.of_options({"batch_invariant": True, **setting})
    assert str(err.value).startswith("engine.batch_invariant=true cannot be combined with")
    assert named in str(err.value)
    assert not BatchInvariance.of_options({"batch_invariant": False, **setting}).enabled


@pytest.mark.parametrize("value", ["true", 1, None])
def test_only_a_bool_is_accepted(value):
    with pytest.raises(ValueError, match=r"engine\.batch_invariant must be true or false"):
        BatchInvariance.of_options({"batch_invariant": value})


def test_dynamic_rope_past_the_trained_context_is_refused():
    """Dynamic NTK's frequencies past max_position_embeddings follow the step's longest
    position: refused there, accepted within (the default context)."""
    kw = dict(dynamic_rope=True, max_position_embeddings=512)
    with pytest.raises(
        ValueError, match="batch_invariant=true cannot be combined with max_seq_len=1024"
    ):
        BatchInvariance.check(True, max_seq_len=1024, **kw)
    assert BatchInvariance.check(True, max_seq_len=512, **kw).enabled
    assert BatchInvariance.check(True, max_seq_len=None, **kw).enabled
    assert BatchInvariance.check(
        True, max_seq_len=1024, dynamic_rope=False, max_position_embeddings=512
    ).enabled
