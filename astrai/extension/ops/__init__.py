"""Thin wrappers over the Triton kernels: KV store, paged decode with split-KV, ragged
prefill/extend, fused rotary.

Each wrapper raises `KernelUnavailable` if its kernel cannot run (no Triton, a CPU tensor
without `TRITON_INTERPRET=1`, bf16 under the interpreter) and never falls back: fallback is
the policy of `astrai.extension.attention`. Import from here only for direct kernel tests,
or where a missing kernel must be an error. `reference` holds a plain-torch version of each.
"""

from astrai.extension.ops._common import KernelUnavailable, unusable

__all__ = [
    "KernelUnavailable",
    "decode_attention",
    "extend_attention",
    "rotary_qk",
    "sgmv_lora",
    "store_kv",
    "unusable",
]


def __getattr__(name: str):
    # Triton is imported only when a kernel is first used, so that `TRITON_INTERPRET` can
    # still be set by then, and machines without Triton can import this package.
    if name == "store_kv":
        from astrai.extension.ops.kv_store import store_kv

        return store_kv
    if name == "decode_attention":
        from astrai.extension.ops.decode import decode_attention

        return decode_attention
    if name == "extend_attention":
        from astrai.extension.ops.extend import extend_attention

        return extend_attention
    if name == "rotary_qk":
        from astrai.extension.ops.rotary import rotary_qk

        return rotary_qk
    if name == "sgmv_lora":
        from astrai.extension.ops.lora import sgmv_lora

        return sgmv_lora
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
