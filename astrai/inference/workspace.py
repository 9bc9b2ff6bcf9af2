"""Fixed-address buffers for the decode hot path.

Every per-step tensor of a decode step lives here, allocated once at start-up: token ids,
positions, request rows, sequence lengths and KV write slots (one `[5, max_bs]` int64
block, filled from a pinned host staging copy with a single transfer), `kv_indptr`,
`qo_indptr`, the attention output and the split-KV partials. A step only writes into
them, so a captured CUDA graph can replay the step with new inputs; no tensor is allocated
and nothing waits for the device. Padded rows (graph batch sizes) decode one token of
request row `pad_row` and write its K/V into the pool's scratch slot, never into real KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from astrai.extension import KVCache
from astrai.inference.cache import PagePool

_IDS, _POS, _ROWS, _LENS, _LOCS = range(5)


class InferenceWorkspace:
    """The decode step's tensors at fixed addresses, staged by `prepare`."""

    def __init__(
        self,
        pool: PagePool,
        *,
        max_batch_size: int,
        n_heads: int,
        head_dim: int,
        num_splits: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        device = pool.device
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.num_splits = num_splits
        self.device = device
        # Allocated with inference mode off: the loop thread updates them in place.
        with torch.inference_mode(False), torch.no_grad():
            pin = device.type == "cuda"
            self.host = torch.zeros((5, max_batch_size), dtype=torch.int64, pin_memory=pin)
            self.meta = torch.zeros((5, max_batch_size), dtype=torch.int64, device=device)
            self.host_np = self.host.numpy()
            self.flat_idx = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
            self.slot_buf = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
            self.kv_indptr = torch.zeros(max_batch_size + 1, dtype=torch.int64, device=device)
            self.qo_indptr = torch.arange(max_batch_size + 1, dtype=torch.int64, device=device)
            self.attn_out = torch.zeros(
                (max_batch_size, n_heads, head_dim), dtype=dtype, device=device
            )
            self.partial_out = torch.zeros(
                (max_batch_size, n_heads, num_splits, head_dim), dtype=torch.float32, device=device
            )
            self.partial_lse = torch.zeros(
                (max_batch_size, n_heads, num_splits), dtype=torch.float32, device=device
            )
        self.last_rows: tuple[int, ...] | None = None
        self.pad_row = 0

    # ------------------------------------------------------------------ views
    @property
    def input_ids(self) -> torch.Tensor:
        return self.meta[_IDS]

    @property
    def positions(self) -> torch.Tensor:
        return self.meta[_POS]

    def kv_cache(self, batch: int, max_len: int) -> KVCache:
        """The `KVCache` over the first `batch` rows of the workspace (views, fixed addresses)."""
        pool = self.pool
        return KVCache(
            k_buffer=pool.k_buffer,
            v_buffer=pool.v_buffer,
            req_to_token=pool.slot_table,
            req_pool_indices=self.meta[_ROWS, :batch],
            seq_lens=self.meta[_LENS, :batch],
            out_cache_loc=self.meta[_LOCS, :batch],
            kv_indptr=self.kv_indptr[: batch + 1],
            qo_indptr=self.qo_indptr[: batch + 1],
            max_len=max_len,
            max_q_len=1,
            seq_lens_host=(),
            q_lens_host=(1,) * batch,
            attn_out=self.attn_out,
            partial_out=self.partial_out,
            partial_lse=self.partial_lse,
        )

    # ------------------------------------------------------------------ per step
    def prepare(
        self,
        rows: Sequence[int],
        seq_lens: Sequence[int],
        tokens: Sequence[int] | None,
        padded: int,
        *,
        device_tokens: torch.Tensor | None = None,
    ) -> None:
        """Stage one decode step for `rows` (request rows), padded to `padded` rows.

        `seq_lens[i]` is the KV length after the step; the fed token sits at position
        `seq_lens[i] - 1` and is written to that position's slot. Token ids come from the
        host (`tokens`) or, when the decoding set is unchanged, are copied device-to-device
        from the previous step's samples (`device_tokens`).
        """
        bs = len(rows)
        if not 0 < bs <= padded <= self.max_batch_size:
            raise ValueError(f"decode batch {bs} padded to {padded} exceeds {self.max_batch_size}")
        # Host side through numpy views of the pinned staging block: no torch allocation.
        host = self.host_np
        host[_ROWS, :bs] = rows
        host[_LENS, :bs] = seq_lens
        host[_POS, :bs] = host[_LENS, :bs] - 1
        if tokens is not None:
            host[_IDS, :bs] = tokens
        host[_IDS, bs:padded] = 0
        host[_POS, bs:padded] = 0
        host[_ROWS, bs:padded] = self.pad_row
        host[_LENS, bs:padded] = 1
        self.meta[:, :padded].copy_(self.host[:, :padded], non_blocking=True)
        if device_tokens is not None:
            self.meta[_IDS, :bs].copy_(device_tokens)
        # Write slots gathered on the device: req_to_token[row, position] via the flat table.
        table = self.pool.slot_table
        idx = self.flat_idx[:padded]
        torch.mul(self.meta[_ROWS, :padded], table.shape[1], out=idx)
        idx.add_(self.meta[_POS, :padded])
        torch.index_select(table.view(-1), 0, idx, out=self.slot_buf[:padded])
        locs = self.meta[_LOCS, :padded]
        locs.copy_(self.slot_buf[:padded])
        locs[bs:padded].fill_(self.pool.scratch_slot)  # padded rows never touch real KV
        torch.cumsum(self.meta[_LENS, :padded], 0, out=self.kv_indptr[1 : padded + 1])
        self.last_rows = tuple(rows)
