"""The engine's proposer for its `engine.speculative` setting (`astrai.inference.speculative`).

Its own module, so that the n-gram proposer (pure Python) and the draft model's (a second
model and KV pool, `astrai.inference.draft`) are both reachable without an import circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astrai.inference.draft import DraftModelProposer
from astrai.inference.speculative import NgramProposer, Proposer, SpeculativeConfig


def make_proposer(
    speculative: SpeculativeConfig | Mapping[str, Any] | None,
    model: Any,
    max_batch_size: int,
    max_seq_len: int | None,
) -> tuple[SpeculativeConfig | None, Proposer | None]:
    """The engine's checked `speculative` setting and its proposer (None, None: off)."""
    config = SpeculativeConfig.of(speculative)
    if config is None:
        return None, None
    if config.method == "ngram":
        return config, NgramProposer(config)
    return config, DraftModelProposer(config, model, max_batch_size, max_seq_len)
