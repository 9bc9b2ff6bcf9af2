"""Batch-invariant kernels: a row's result independent of the other rows of its call.

On the CPU, torch's matmul of one row depends on how many rows the product has (MKL and
oneDNN choose their blocking by the row count M): a request decoded alone and the same
request decoded beside others differ by an ulp or two in their log-probs. Inside
`with batch_invariant(True):` (the engine's `batch_invariant` option, after vLLM's
`VLLM_BATCH_INVARIANT` and SGLang's `--enable-deterministic-inference`):

- `astrai.extension.linear` (every product of the model, its LM head included) runs in
  blocks of exactly `INVARIANT_ROWS` rows, the last one padded with zero rows: each block
  is the same product shape, and each row of a block comes out with the same bits whatever
  its neighbours and its place in the block (measured for K, N up to 4096 with MKL and
  oneDNN, 1 and 2 threads: `tests/extension/test_invariance.py`);
- the torch_native attention backend attends per request over exactly its own keys (no
  batch padded to the longest row), with a kernel chosen by the request's own query and key
  lengths only;
- LoRA deltas are products of the same fixed blocks, per adapter; MLA's absorbed
  projections (`invariant_rows`) too, and its latent attention runs per request.

A context variable, so the scope is per thread: the engine's runner enters it around its
forward (on the loop's thread or `run_batch`'s caller's), and a training forward in the
same process is unaffected. Same device, dtype and torch thread count are assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

# rows of every product in batch-invariant mode (one shape per weight: one kernel choice)
INVARIANT_ROWS = 16

_enabled: ContextVar[bool] = ContextVar("astrai_batch_invariant", default=False)


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run this context's products and attention batch-invariantly (`enabled`), or not;
    nestable, the previous setting is restored on exit."""
    token = _enabled.set(bool(enabled))
    try:
        yield
    finally:
        _enabled.reset(token)


def batch_invariant_enabled() -> bool:
    """Whether this context runs batch-invariantly (`batch_invariant`)."""
    return _enabled.get()


def in_row_blocks(
    x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor], rows: int = INVARIANT_ROWS
) -> torch.Tensor:
    """`product(x)` for a row-wise `product` of a `[..., in]` tensor, computed in blocks of
    exactly `rows` rows (the last padded with zero rows, whose results are dropped): a row's
    result does not depend on how many rows `x` has nor where the row sits."""
    lead, width = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, width)
    total = flat.shape[0]
    pad = -total % rows
    if pad or total == 0:
        flat = F.pad(flat, (0, 0, 0, pad if total else rows))
    outs = [product(flat[i : i + rows]) for i in range(0, flat.shape[0], rows)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:total].reshape(*lead, out.shape[-1])


def invariant_rows(
    x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`product(x)` for a product computed row by row over the first axis of `x [T, ...]`
    (an einsum over heads, say): in batch-invariant mode in blocks of exactly
    `INVARIANT_ROWS` rows (zero rows pad the last), else at once."""
    if not batch_invariant_enabled():
        return product(x)
    total = x.shape[0]
    pad = -total % INVARIANT_ROWS or (INVARIANT_ROWS if total == 0 else 0)
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    outs = [product(x[i : i + INVARIANT_ROWS]) for i in range(0, x.shape[0], INVARIANT_ROWS)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[:total]


__all__ = [
    "INVARIANT_ROWS",
    "batch_invariant",
    "batch_invariant_enabled",
    "in_row_blocks",
    "invariant_rows",
]
