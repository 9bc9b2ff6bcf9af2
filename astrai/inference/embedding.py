"""Embeddings of whole prompts: a model's final hidden states (after the final norm),
pooled (vLLM's `pooling_type` names: `mean`, `last`, `cls`) and L2-normalised (vLLM's
`normalize`), as `POST /v1/embeddings` returns them.

Prompts are forwarded in batches, padding-free: the prompts of one batch are packed into
one row with position ids restarting at each prompt, so each attends only within itself
(`Transformer.forward`'s packed documents), up to `max_batch_tokens` tokens per forward
(a longer prompt gets a forward of its own). No KV cache is involved.

Two sources (`Embedder.of_engine`, `Embedder.from_pretrained`): the served model itself,
forwarded while the engine's loop is paused (`engine.loop.paused()`, as weight updates
run), so a forward never runs concurrently with a decode step; or a separate embedding
export (`python -m astrai.serve embedding_model=<dir>`) with no engine at all. Imports no
torch until used, so the server's settings can name `POOLING_TYPES` before torch loads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def embed_packed(
    model: Any,
    prompts: Sequence[Sequence[int]],
    pooling_type: str,
    max_batch_tokens: int,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """Each prompt's `[D]` float32 embedding (on the CPU), in order, from padding-free packed
    forwards of at most `max_batch_tokens` tokens (`astrai.model.reward.pack_sequences`:
    the reward scorer's packing). Call it under `torch.inference_mode()`."""
    import torch

    from astrai.model.reward import pack_sequences

    out: list[torch.Tensor] = [None] * len(prompts)  # type: ignore[list-item]
    for pack in pack_sequences([len(p) for p in prompts], max_batch_tokens):
        ids = [t for i in pack for t in prompts[i]]
        pos = [p for i in pack for p in range(len(prompts[i]))]
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        position_ids = torch.tensor([pos], dtype=torch.long, device=device)
        hidden = model(input_ids, position_ids=position_ids, return_hidden=True)[0]
        vectors, start = [], 0
        for i in pack:
            end = start + len(prompts[i])
            vectors.append(pool(hidden[start:end], pooling_type))
            start = end
        for i, vector in zip(pack, torch.stack(vectors).cpu(), strict=True):
            out[i] = vector
    return out


class Embedder:
    """Embeds prompts with one model, one request's batches at a time (a lock: two requests
    never pause and resume the engine's loop across each other, nor hold two batches'
    activations at once).

    `name`: the id requests give as `model`; `max_seq_len`: the longest prompt accepted;
    `paused`: a context manager factory held around each request's forwards (the engine's
    `loop.paused` for the served model; none for a separate export).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        pooling_type: str,
        *,
        name: str,
        max_seq_len: int,
        vocab_size: int,
        device: torch.device | str,
        max_batch_tokens: int | None = None,
        paused: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        from astrai.model.reward import DEFAULT_MAX_BATCH_TOKENS

        self.model = model
        self.tokenizer = tokenizer
        self.pooling_type = check_choice("pooling_type", pooling_type, POOLING_TYPES)
        self.name = name
        self.max_seq_len = int(max_seq_len)
        self.vocab_size = int(vocab_size)
        self.device = device
        self.max_batch_tokens = max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: must be >= 1, got {self.max_batch_tokens}")
        self.paused = paused
        self._lock = threading.Lock()

    @classmethod
    def of_engine(
        cls,
        engine: InferenceEngine,
        pooling_type: str,
        name: str,
        max_batch_tokens: int | None = None,
    ) -> Embedder:
        """The served model's embedder: forwards run with `engine`'s loop paused."""
        return cls(
            engine.model,
            engine.tokenizer,
            pooling_type,
            name=name,
            max_seq_len=engine.max_seq_len,
            vocab_size=engine.vocab_size,
            device=engine.device,
            max_batch_tokens=max_batch_tokens,
            paused=engine.loop.paused,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        pooling_type: str,
        *,
        tokenizer: Any = None,
        name: str | None = None,
        device: str = "cpu",
        dtype: Any = None,
        max_batch_tokens: int | None = None,
    ) -> Embedder:
        """A separate embedding export (ours or an HF directory `AutoModel` reads), with the
        directory's own tokenizer when it has one, else `tokenizer` (the served model's).
        `name`: None is the directory's name."""
        from astrai.model import AutoModel
        from astrai.model.directory import TOKENIZER_NAME
        from astrai.tokenizer import AutoTokenizer

        path = Path(path).expanduser()
        model = AutoModel.from_pretrained(path, device=device, dtype=dtype).eval()
        if (path / TOKENIZER_NAME).is_file():
            tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer is None:
            raise ValueError(f"embedding_model={path}: no {TOKENIZER_NAME}, and no tokenizer given")
        return cls(
            model,
            tokenizer,
            pooling_type,
            name=name or path.resolve().name,
            max_seq_len=model.config.max_position_embeddings,
            vocab_size=model.config.vocab_size,
            device=next(model.parameters()).device,
            max_batch_tokens=max_batch_tokens,
        )

    def encode(self, text: str) -> list[int]:
        """A text's token ids, without a chat template (as vLLM embeds)."""
        return self.tokenizer.encode(text)

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Each prompt's `[D]` float32 embedding, on the CPU. Blocking: call it off the
        event loop."""
        import torch

        with self._lock, self.paused(), torch.inference_mode():
            return embed_packed(
                self.model, prompts, self.pooling_type, self.max_batch_tokens, self.device
            )
