"""Per-request logits processors (vLLM's shape): applying them to a step.

A logits processor is a callable `(generated_ids, logits_row) -> logits_row`: it gets the
request's generated token ids so far and its `[vocab]` fp32 logits, and returns new logits
(it may edit them in place). Processors run per row, in order, before penalties, bias and
temperature; the returned log-probs are under the processed logits (vLLM's convention).
A processor that raises fails its own request only (`astrai.inference.isolation`). The
type and the request's check (a sequence of callables) are `params.py`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from astrai.inference.params import LogitsProcessor


def processor_name(proc: object) -> str:
    """A readable name for error messages: the function's qualified name, or its type."""
    return getattr(proc, "__qualname__", None) or type(proc).__qualname__


def apply_logits_processors(
    logits: torch.Tensor,
    processors: Sequence[Sequence[LogitsProcessor]],
    generated: Sequence[Sequence[int]],
) -> dict[int, str]:
    """Run row `i`'s `processors[i]` on `logits[i]` (`[B, V]` fp32, edited in place), given
    the tokens `generated[i]` its request produced so far.

    Returns `{row: error}` for the rows whose processor raised, returned something other
    than a `[V]` tensor, or left no finite logit; such a row's logits are left as they were.
    """
    faults: dict[int, str] = {}
    vocab = logits.shape[-1]
    for i, procs in enumerate(processors):
        if not procs:
            continue
        row = logits[i].clone()
        ids = list(generated[i])
        proc: object = None
        try:
            for proc in procs:
                row = proc(ids, row)
                if not isinstance(row, torch.Tensor) or tuple(row.shape) != (vocab,):
                    got = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
                    raise TypeError(f"returned {got}, expected a [{vocab}] tensor")
            row = row.to(device=logits.device, dtype=logits.dtype)
            if not bool(torch.isfinite(row).any()) or bool(torch.isnan(row).any()):
                raise ValueError("left no finite logit (or a NaN)")
        except Exception as err:
            faults[i] = f"logits processor {processor_name(proc)} failed: {describe(err)}"
            continue
        logits[i] = row
    return faults


def describe(err: BaseException) -> str:
    """`TypeName: message`, the form request errors name their cause in."""
    return f"{type(err).__name__}: {err}"
