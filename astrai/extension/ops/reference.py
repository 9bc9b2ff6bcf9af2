"""Plain-torch references for every Triton kernel, written for clarity, not speed.

The kernel tests compare against these; they share no code with the kernels.
"""

from __future__ import annotations

import torch


def store_kv_ref(k, v, k_buffer, v_buffer, out_cache_loc) -> None:
    k_buffer[out_cache_loc] = k.to(k_buffer.dtype)
    v_buffer[out_cache_loc] = v.to(v_buffer.dtype)


def _attend(q, keys, values, visible, scale, sinks=None):
    """q [n, H, D], keys/values [L, Hkv, D], visible [n, L] -> [n, H, D] in float64; `sinks`
    [H]: one more softmax column per head that no value stands behind."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hnl,lhd->nhd", probs, values)
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)


def extend_attention_ref(
    q,
    k_buffer,
    v_buffer,
    req_to_token,
    req_pool_indices,
    seq_lens,
    qo_indptr,
    scale,
    window=None,
    sinks=None,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for b in range(seq_lens.shape[0]):
        start, stop = int(qo_indptr[b]), int(qo_indptr[b + 1])
        n, length = stop - start, int(seq_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), :length].long()
        pos = (length - n) + torch.arange(n)[:, None]
        visible = torch.arange(length)[None, :] <= pos
        if window is not None:  # sliding window: keys pos - window < t <= pos
            visible &= torch.arange(length)[None, :] > pos - window
        out[start:stop] = _attend(
            q[start:stop], k_buffer[slots], v_buffer[slots], visible, scale, sinks
        ).to(q.dtype)
    return out


def decode_attention_ref(
    q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale, window=None, sinks=None
):
    qo_indptr = torch.arange(q.shape[0] + 1)
    return extend_attention_ref(
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        qo_indptr,
        scale,
        window,
        sinks,
    )


def rotary_qk_ref(q, k, cos, sin):
    def rotate(x):
        x1, x2 = x.double().chunk(2, dim=-1)
        c, s = cos.double()[:, None], sin.double()[:, None]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def sgmv_lora_reference(x, a3, bt3, token_slots, scalings, out) -> None:
    """`out[t] += scalings[s] * (x[t] @ a3[s].T) @ bt3[s]` for `s = token_slots[t] >= 0`,
    in place, one slot at a time, in float64."""
    slots = token_slots.long().cpu()
    for s in slots.unique().tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero()[:, 0].to(out.device)
        h = x[rows].double() @ a3[s].double().t()
        delta = (h @ bt3[s].double()) * float(scalings[s])
        out[rows] = (out[rows].double() + delta).to(out.dtype)
