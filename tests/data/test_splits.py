"""The split assignment and the distinct-draw loop every built-in generator shares."""

from __future__ import annotations

import itertools

import pytest

from astrai.data.splits import draw_in_split, in_split


def _counter_draws(keys):
    """A draw per key in turn; None for keys that are None (a rejected draw)."""
    it = iter(keys)

    def draw():
        key = next(it)
        if key is None:
            return None
        return key, lambda index: (index, key)

    return draw


def test_kept_items_are_in_the_split_distinct_and_built_from_their_index():
    keys = [f"k{i % 40}" for i in range(400)]
    items = draw_in_split(
        _counter_draws(keys), 20, split="val", val_fraction=0.5, unique=True, what="t"
    )
    assert [index for index, _ in items] == list(range(20))
    kept = [key for _, key in items]
    assert len(set(kept)) == 20 and all(in_split(k, "val", 0.5) for k in kept)
    # in draw order: the first 20 distinct val keys
    expected = [k for k in dict.fromkeys(keys) if in_split(k, "val", 0.5)][:20]
    assert kept == expected


def test_rejected_draws_are_skipped_and_repeats_kept_without_unique():
    keys = [None, "a", None, "a", "a"]
    items = draw_in_split(
        _counter_draws(keys), 3, split=None, val_fraction=0.1, unique=False, what="t"
    )
    assert items == [(0, "a"), (1, "a"), (2, "a")]


def test_asking_for_more_distinct_items_than_the_split_holds_names_the_generator():
    draw = _counter_draws(itertools.cycle(["x", "y", "z"]))
    with pytest.raises(ValueError, match=r"gen \(n=3\): cannot draw 4 distinct problems"):
        draw_in_split(draw, 4, split=None, val_fraction=0.1, unique=True, what="gen (n=3)")
