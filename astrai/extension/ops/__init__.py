"""Thin wrappers over the Triton kernels (paged decode with split-KV, ragged prefill/extend,
KV store, rotary).

The kernels land in a later issue. Each wrapper will raise if its kernel cannot run (no
Triton, wrong device, dtype or shape) and never fall back: fallback is the policy of
`astrai.extension.attention`. Import from here only for direct kernel tests, or where a
missing kernel must be an error.
"""
