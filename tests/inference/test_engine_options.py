"""`check_engine_blocks`: the engine's optional blocks checked, by the engine's own classes,
before a command loads its model."""

import pytest

from astrai.inference.engine_options import check_engine_blocks
from astrai.inference.speculative import SpeculativeConfig


def test_null_blocks_are_off():
    assert check_engine_blocks({"lora": None, "speculative": None}) is None
    assert check_engine_blocks({}) is None


def test_a_good_speculative_block_is_returned_as_the_engine_reads_it():
    spec = check_engine_blocks({"speculative": {"method": "ngram", "num_speculative_tokens": 3}})
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)


@pytest.mark.parametrize(
    ("engine", "named"),
    [
        ({"lora": {"max_loras": 0}}, "engine.lora"),
        ({"lora": {"max_lora_rnk": 8}}, "engine.lora"),
        ({"speculative": {"method": "eagle9"}}, "engine.speculative"),
        ({"speculative": {"method": "ngram", "num_speculative_tokens": -1}}, "engine.speculative"),
        (
            {"speculative": {"method": "draft_model", "model": "/no/such/dir"}},
            "engine.speculative.model",
        ),
    ],
)
def test_a_bad_block_is_one_line_naming_its_key(engine, named):
    with pytest.raises(SystemExit) as err:
        check_engine_blocks(engine)
    message = str(err.value)
    assert named in message and "\n" not in message.strip()
