"""`astrai.inference.ngram`: prompt lookup over a request's own tokens."""

from astrai.inference.ngram import NgramIndex, NgramProposer
from astrai.inference.params import SamplingParams
from astrai.inference.speculative import SpeculativeConfig
from astrai.inference.task import Task


def test_lookup_takes_the_longest_earlier_suffix_match():
    index = NgramIndex(1, 3)
    seq = [1, 2, 3, 4, 9, 2, 3]
    # suffix [2, 3] occurred at 1..2, followed by 4, 9
    assert index.lookup(seq, 2) == [4, 9]


def test_no_earlier_occurrence_proposes_nothing():
    assert NgramIndex(1, 4).lookup([1, 2, 3, 4], 3) == []


def test_the_proposer_keeps_one_index_per_request_and_respects_budgets():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3))
    assert proposer.num_speculative_tokens == 3
    a = Task([5, 6, 7, 5, 6], SamplingParams(max_tokens=8))
    b = Task([1, 2, 3], SamplingParams(max_tokens=8))
    assert proposer.propose([a, b], [2, 2]) == [[7, 5], []]
    assert proposer.propose([a], [0]) == [[]]
