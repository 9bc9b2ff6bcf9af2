"""strategy.rewards: registry names and Hydra `_target_` entries, parsed and built once (bad
entries fail naming strategy.rewards[i]), then scored as a weighted sum."""

import pickle

import pytest
from omegaconf import OmegaConf

from astrai.train.strategies.grpo.reward_pool import score
from astrai.train.strategies.grpo.rewards import WeightedReward, parse_rewards

HERE = __name__  # rewards defined below are plugged in by import path, as a user's would be


def length_at_most(record, completion, limit=5):
    """A user's reward function with an option (`_partial_: true` binds it)."""
    return 1.0 if len(completion) <= limit else 0.0


class Contains:
    """A user's reward class: the instance is the reward."""

    def __init__(self, word):
        self.word = word

    def __call__(self, record, completion):
        return 1.0 if self.word in completion else 0.0


class BatchOnly:
    """A reward that only works through `batch`: score must prefer it."""

    calls = 0

    def __call__(self, record, completion):
        raise AssertionError("score called the per-item method of a reward with batch()")

    def batch(self, records, completions):
        BatchOnly.calls += 1
        return [float(len(c)) for c in completions]


def fails_on_b(record, completion):
    if completion == "b":
        raise ValueError("boom")
    return 0.0


def returns_nan(record, completion):
    return float("nan")


NOT_CALLABLE = 3


class NoCall:
    """Builds, but its instance is not a reward."""


def test_config_forms_parse_and_score():
    config = OmegaConf.create(  # as it arrives from YAML
        [
            "exact_match",
            {"name": "format", "weight": 0.5},
            {"_target_": f"{HERE}.length_at_most", "_partial_": True, "limit": 20, "weight": 2},
            {"_target_": f"{HERE}.Contains", "word": "cat", "name": "has_cat", "weight": -1},
        ]
    )
    rewards = parse_rewards(config)
    assert rewards == [
        ("exact_match", 1.0),
        ("format", 0.5),
        ("length_at_most", 2.0),  # the target's last dotted component
        ("has_cat", -1.0),
    ]
    assert all(isinstance(r, WeightedReward) for r in rewards)
    records = [{"answer": "5"}, {"answer": "5"}, {"answer": "7"}]
    texts = ["The answer is 5.", "a cat said 5, then 6, then 7 and more", "cat: 7"]
    total, parts = score(records, texts, rewards)
    # by hand: exact + 0.5 * format + 2 * (len <= 20) - (cat in text)
    expected = [1 + 0.5 + 2 - 0, 0 + 0 + 0 - 1, 1 + 0 + 2 - 1]
    assert total.tolist() == expected
    assert parts["length_at_most"].item() == pytest.approx(2 / 3)
    assert set(parts) == {"exact_match", "format", "length_at_most", "has_cat"}
    assert score(records, texts, rewards)[0].tolist() == expected  # parsed entries reused


def test_short_forms():
    assert parse_rewards("format") == [("format", 1.0)]
    assert parse_rewards({"format": 0.1, "exact_match": 2}) == [
        ("format", 0.1),
        ("exact_match", 2.0),
    ]
    single = parse_rewards({"_target_": f"{HERE}.Contains", "word": "x"})
    assert single == [("Contains", 1.0)]
    assert single[0].fn(None, "xyz") == 1.0
    assert parse_rewards([("format", 0.25)]) == [("format", 0.25)]
    restored = pickle.loads(pickle.dumps(parse_rewards(["math_answer"])))
    assert restored == [("math_answer", 1.0)] and restored[0].fn({"answer": "2"}, "2") == 1.0


def test_a_reward_with_batch_is_scored_through_it():
    BatchOnly.calls = 0
    rewards = parse_rewards([{"_target_": f"{HERE}.BatchOnly", "weight": 0.5}])
    total, parts = score([{}, {}], ["ab", "abcd"], rewards)
    assert total.tolist() == [1.0, 2.0] and parts["BatchOnly"].item() == 3.0
    assert BatchOnly.calls == 1


@pytest.mark.parametrize(
    ("entry", "error", "message"),
    [
        (
            "no_such_reward",
            KeyError,
            r"strategy.rewards\[1\]: unknown reward.*available.*math_answer",
        ),
        ({"_target_": "no_such_pkg.reward", "_partial_": True}, ImportError, "not importable"),
        ({"_target_": f"{HERE}.NOT_CALLABLE"}, ValueError, r"rewards\[1\]: .*callable"),
        ({"_target_": f"{HERE}.NoCall"}, TypeError, r"rewards\[1\]: .*NoCall.*not callable"),
        ({"_target_": f"{HERE}.length_at_most"}, ValueError, "needs `_partial_: true`"),
        ({"_target_": f"{HERE}.Contains", "_partial_": True, "word": "x"}, ValueError, "drop"),
        ({"_target_": f"{HERE}.Contains"}, ValueError, "word"),  # constructor's own error
        ({"name": "format"}, ValueError, "already used by strategy.rewards\\[0\\]"),
        ({"name": "code_tests", "retries": 2}, ValueError, r"unknown keys \['retries'\]"),
        ({"name": "code_tests", "timeout": 0}, ValueError, r"rewards\[1\].timeout"),
        ({"name": "code_tests", "failure_value": "x"}, ValueError, r"rewards\[1\].failure_value"),
        ({"weight": 2}, KeyError, "needs 'name'.*or '_target_'"),
        ({"name": "exact_match", "weight": "high"}, ValueError, r"rewards\[1\].weight"),
        (length_at_most, TypeError, "already built"),
    ],
)
def test_bad_entries_fail_naming_the_entry(entry, error, message):
    with pytest.raises(error, match=message):
        parse_rewards(["format", entry])


def test_no_reward_at_all_is_refused():
    with pytest.raises(ValueError, match="at least one reward"):
        parse_rewards([])


def test_a_reward_that_raises_gives_its_failure_value_and_logs_once(caplog):
    # #48 changed this: a raising or non-finite reward used to stop the run with a
    # RuntimeError; it now gives its failure_value (default 0.0), counted and logged once.
    rewards = parse_rewards(
        [{"_target_": f"{HERE}.fails_on_b", "_partial_": True, "failure_value": -1.0}]
    )
    with caplog.at_level("WARNING"):
        total, _ = score([{}, {}, {}, {}], ["a", "b", "c", "b"], rewards)
    assert total.tolist() == [0.0, -1.0, 0.0, -1.0]
    logged = [r for r in caplog.records if "'fails_on_b' failed" in r.getMessage()]
    assert len(logged) == 1 and "ValueError: boom" in logged[0].getMessage()
    total, _ = score([{}], ["The answer is 5."], ["exact_match"])  # the record lacks 'answer'
    assert total.tolist() == [0.0]
    nan = parse_rewards([{"_target_": f"{HERE}.returns_nan", "_partial_": True}])
    assert score([{}], ["a"], nan)[0].tolist() == [0.0]


def test_rewards_registered_by_path_are_imported_on_first_use():
    from astrai.data.rewards import REWARDS, get_reward, register_reward_path

    register_reward_path("test_lazy_fn", f"{HERE}.length_at_most")
    register_reward_path("test_lazy_missing", f"{HERE}.no_such_thing")
    try:
        assert REWARDS["test_lazy_fn"] == f"{HERE}.length_at_most"  # not imported yet
        assert get_reward("test_lazy_fn") is length_at_most
        assert REWARDS["test_lazy_fn"] is length_at_most  # imported once
        with pytest.raises(ImportError, match="'test_lazy_missing': cannot import"):
            get_reward("test_lazy_missing")
        with pytest.raises(ImportError, match=r"strategy.rewards\[0\]: .*cannot import"):
            parse_rewards(["test_lazy_missing"])
        with pytest.raises(ValueError, match="already registered"):
            register_reward_path("test_lazy_fn", f"{HERE}.Contains")
    finally:
        REWARDS.pop("test_lazy_fn")
        REWARDS.pop("test_lazy_missing")


def test_timeout_and_failure_value_are_the_entry_s_and_a_target_s_own_timeout_stays():
    plain, code = parse_rewards(
        [
            {"name": "exact_match", "timeout": 1.5, "failure_value": -1},
            {"_target_": "astrai.eval.code_reward.CodeTests", "timeout": 2, "call_timeout": 30},
        ]
    )
    assert (plain.timeout, plain.failure_value) == (1.5, -1.0)
    assert code.timeout == 30.0 and code.fn.timeout == 2.0  # CodeTests' per-program timeout
    assert pickle.loads(pickle.dumps(plain)).timeout == 1.5
    with pytest.raises(ValueError, match="not both"):
        parse_rewards(
            [{"_target_": f"{HERE}.fails_on_b", "_partial_": True, "timeout": 1, "call_timeout": 2}]
        )
