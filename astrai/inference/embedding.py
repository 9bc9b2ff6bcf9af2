"""Embeddings of whole prompts: the model's final hidden states (after the final norm),
pooled (vLLM's `pooling_type` names: `mean`, `last`, `cls`) and L2-normalised (vLLM's
`normalize`), as `POST /v1/embeddings` returns them.

The forward runs outside the engine's paged KV cache, on the served model itself, while
the engine's loop is paused (`engine.loop.paused()`, as weight updates run): one dense
forward per prompt, never concurrent with a decode step. Imports no torch until used, so
the server's settings can name `POOLING_TYPES` before torch loads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from astrai.inference.params import check_choice

if TYPE_CHECKING:
    import torch

    from astrai.inference import InferenceEngine

# mean: the average over the prompt's tokens; last: the last token's state (a causal
# model's summary of the whole prompt, vLLM's default for decoder embedders); cls: the first.
POOLING_TYPES = ("last", "mean", "cls")


def pool(hidden: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One prompt's `[S, D]` final-normed hidden states -> its unit-length `[D]` float32
    embedding."""
    import torch.nn.functional as F

    states = hidden.float()
    if pooling_type == "mean":
        pooled = states.mean(dim=0)
    elif pooling_type == "last":
        pooled = states[-1]
    elif pooling_type == "cls":
        pooled = states[0]
    else:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}")
    return F.normalize(pooled, p=2, dim=-1)


class Embedder:
    """Embeds token-id prompts with `engine`'s model, one forward at a time (a lock: two
    requests never pause and resume the loop across each other)."""

    def __init__(self, engine: InferenceEngine, pooling_type: str) -> None:
        self.engine = engine
        self.pooling_type = check_choice("pooling_type", pooling_type, POOLING_TYPES)
        self._lock = threading.Lock()

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each prompt's `[D]` float32 embedding, on the CPU. Blocking: call it off the
        event loop."""
        import torch

        model, device = self.engine.model, self.engine.device
        out = []
        with self._lock, self.engine.loop.paused(), torch.inference_mode():
            for ids in prompts:
                batch = torch.tensor([list(ids)], dtype=torch.long, device=device)
                hidden = model(batch, return_hidden=True)[0]
                out.append(pool(hidden, self.pooling_type).cpu())
        return out
