"""Attention of a training forward over packed documents, without a sequence x sequence mask.

A padding-free batch (TRL's ``padding_free``: the real tokens of several sequences in one row,
position ids restarting at 0 for each) needs attention to stay inside each document. A
boolean ``[B, 1, S, S]`` mask says that in O(S^2) memory (64 MiB of mask for one 8k-token row,
plus SDPA's materialised ``[heads, S, S]`` scores on the CPU, where no fused kernel takes a
mask). :class:`DocumentSpans` instead lists each document's ``[start, end)`` in its row, once
per forward (all layers share it), and :func:`training_attention` runs causal SDPA on each
span: the same arithmetic per query as the masked path (the keys it sees are exactly the ones
the mask allows), with memory O(longest document^2) in the worst case and none for the mask.

A right-padded batch of packed windows is spans too: the padding tail of a row is one more
span (its queries attend among themselves, and no real token attends to it), so the real
tokens' outputs, the loss and every gradient are the dense mask's.

The spans also come as ``cu_seqlens``: the cumulative lengths over the flattened ``B * S``
tokens, int32 (flash-attn's varlen layout; the collate of packed windows carries them, see
``astrai.data.datasets.collate_lm``). On CUDA in fp16 / bf16 with flash attention available,
:meth:`DocumentSpans.attend` hands them to ``torch.nn.attention.varlen.varlen_attn`` (one
kernel for the whole batch); elsewhere it loops over the spans. torch 2.13's varlen route
has no CPU kernel, and SDPA on jagged nested tensors refuses ``is_causal=True`` ("No viable
backend"), so the span loop is the CPU path.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

from astrai.extension.backend.sinks import sink_softmax_attention


class DocumentSpans:
    """Where each packed document of a ``[B, S]`` batch lies: ``spans[b]`` is the list of
    ``(start, end)`` of row ``b``'s documents, covering ``[0, S)`` in order."""

    def __init__(self, spans: list[list[tuple[int, int]]]) -> None:
        self.spans = spans

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """The spans as flash-attn's ``cu_seqlens``: int32 ``[documents + 1]``, the start of
        every document in the flattened ``B * S`` tokens, then ``B * S``."""
        width = self.spans[0][-1][1] if self.spans and self.spans[0] else 0
        cuts = [b * width + start for b, row in enumerate(self.spans) for start, _ in row]
        return torch.tensor([*cuts, len(self.spans) * width], dtype=torch.int32)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, seq: int) -> DocumentSpans:
        """From ``cu_seqlens`` over a ``[batch, seq]`` batch flattened (no span may cross a
        row's end): what the collate of packed windows carries."""
        cuts = cu_seqlens.tolist()
        if (
            cu_seqlens.dim() != 1
            or len(cuts) < 2
            or cuts[0] != 0
            or cuts[-1] != batch * seq
            or any(b <= a for a, b in pairwise(cuts))
            or not set(range(0, batch * seq + 1, seq)) <= set(cuts)
        ):
            raise ValueError(
                f"cu_seqlens: expected increasing int offsets from 0 to {batch * seq} that "
                f"include every row's end (a multiple of {seq}), got {cuts}"
            )
        spans: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
        for start, end in pairwise(cuts):
            row = start // seq
            spans[row].append((start - row * seq, end - row * seq))
        return cls(spans)

    @classmethod
    def from_starts(cls, starts: torch.Tensor) -> DocumentSpans:
        """From a ``[B, S]`` bool tensor that is True where a document starts (column 0 is a
        start whether set or not)."""
        b, s = starts.shape
        cuts: list[list[int]] = [[] for _ in range(b)]
        for row, col in starts[:, 1:].nonzero().tolist():  # one device sync per forward
            cuts[row].append(col + 1)
        return cls([list(zip([0, *c], [*c, s])) for c in cuts])

    # Eager under torch.compile (model.compile=true): compiled, every new layout of spans (a
    # GRPO step's completion lengths) would recompile; eager, the layers around it compile
    # once per shape (measured: 0.1 s instead of 22 s for a new layout of the same length).
    @torch.compiler.disable
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        enable_gqa: bool = False,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention within each span; ``q, k, v`` are ``[B, heads, S, head_dim]``;
        `window`: each query also sees only its last `window` keys (sliding window);
        `sinks`: attention sinks (`training_attention`), which flash varlen does not take."""
        if sinks is None and _varlen_fits(q, v):
            return self._attend_varlen(q, k, v, scale=scale, enable_gqa=enable_gqa, window=window)
        rows = []
        for b, spans in enumerate(self.spans):
            parts = [
                training_attention(
                    q[b : b + 1, :, start:end],
                    k[b : b + 1, :, start:end],
                    v[b : b + 1, :, start:end],
                    None,
                    scale=scale,
                    enable_gqa=enable_gqa,
                    window=window,
                    sinks=sinks,
                )
                for start, end in spans
            ]
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)

    def _attend_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        enable_gqa: bool,
        window: int | None,
    ) -> torch.Tensor:
        """All spans in one flash varlen call over the flattened ``[B * S, heads, head_dim]``."""
        from torch.nn.attention.varlen import varlen_attn

        b, heads, s, _dim = q.shape
        cu = self.cu_seqlens.to(q.device)
        longest = max(end - start for row in self.spans for start, end in row)

        def flat(x: torch.Tensor) -> torch.Tensor:
            return x.transpose(1, 2).reshape(b * s, x.shape[1], x.shape[-1])

        out = varlen_attn(
            flat(q),
            flat(k),
            flat(v),
            cu,
            cu,
            longest,
            longest,
            scale=scale,
            window_size=(-1 if window is None else window - 1, 0),  # causal (+ window)
            enable_gqa=enable_gqa,
        )
        return out.reshape(b, s, heads, v.shape[-1]).transpose(1, 2)


def window_mask(seq: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[S, S]`` causal sliding-window mask: query ``i`` sees keys ``i - window < j
    <= i`` (transformers' ``sliding_window_causal_mask_function``); None when the window
    covers the whole sequence (plain causal)."""
    if window is None or window >= seq:
        return None
    pos = torch.arange(seq, device=device)
    diff = pos[:, None] - pos[None, :]
    return (diff >= 0) & (diff < window)


def _varlen_fits(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether flash varlen attention takes ``q, v``: CUDA (sm80+), fp16 / bf16, one head size
    of at most 256 for queries and values (not MLA's), flash available."""
    return (
        q.is_cuda
        and q.shape[-1] == v.shape[-1] <= 256
        and q.dtype in (torch.float16, torch.bfloat16)
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


def training_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: torch.Tensor | DocumentSpans | None,
    *,
    scale: float,
    enable_gqa: bool = False,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the dense training forward, ``q, k, v`` as ``[B, heads, S, head_dim]``:
    causal (``layout`` None), under a boolean ``[B, 1, S, S]`` mask (padding), or within the
    spans of packed documents (:class:`DocumentSpans`); `window` (a sliding-window layer)
    further limits each query to its last `window` keys, HF's meaning. `sinks` (``[heads]``,
    GPT-OSS) join each softmax's denominator (`astrai.extension.backend.sinks`)."""
    if isinstance(layout, DocumentSpans):
        return layout.attend(
            q, k, v, scale=scale, enable_gqa=enable_gqa, window=window, sinks=sinks
        )
    local = window_mask(q.shape[2], window, q.device)
    if local is not None:
        layout = local if layout is None else layout & local
    if sinks is not None:
        if layout is None:
            layout = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
        return sink_softmax_attention(q, k, v, layout, scale, sinks)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=layout,
        is_causal=layout is None,
        scale=scale,
        enable_gqa=enable_gqa,
    )
