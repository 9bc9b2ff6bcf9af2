"""The decoder-only Transformer (Llama / Qwen2 / Qwen3 / Mistral family)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from astrai.extension import KVCache
from astrai.model.config import ModelConfig
from astrai.model.documents import DocumentSpans
from astrai.model.gemma_layers import make_embedding, make_rotary, norm_class
from astrai.model.head import HeadSettings, TokenScores, head_scores
from astrai.model.layers import Attention, Linear, RMSNorm
from astrai.model.mla import make_attention
from astrai.model.moe import MoE, RouterStats, make_mlp, router_losses, router_stats
from astrai.model.sandwich import SandwichBlock
from astrai.vocab import VocabShard


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        norm = norm_class(config)
        self.layer_id = layer_id
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = make_attention(config, layer_id)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer_id)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | DocumentSpans | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class PostNormBlock(nn.Module):
    """Post-norm block (OLMo 2): x + norm(attn(x)), then x + norm(mlp(x)); no input norm."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        norm = norm_class(config)
        self.layer_id = layer_id
        self.self_attn = make_attention(config, layer_id)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config, layer_id)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | DocumentSpans | None = None,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, attn_mask))
        return x + self.post_feedforward_layernorm(self.mlp(x))

    def forward_cached(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn.forward_cached(x, cos, sin, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))


#: the block type of each `ModelConfig.norm_position`
BLOCKS: dict[str, type[nn.Module]] = {
    "pre": DecoderBlock,
    "post": PostNormBlock,
    "sandwich": SandwichBlock,  # Gemma 3 (astrai/model/sandwich.py)
}


def document_mask(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
) -> torch.Tensor | DocumentSpans | None:
    """How a training forward attends: None when causal suffices; the spans of packed
    documents (`astrai.model.documents`, no `[S, S]` mask) when position ids restart and
    nothing is padded (a padding-free batch) or only rows' ends are (right-padded packed
    windows: the padding tail is one more span); else (left padding, or padding without
    packed documents) a boolean `[B, 1, S, S]` mask.

    A new document starts wherever a position id is not its predecessor plus one, so tokens
    never attend across the boundary of packed documents. Padding keys are masked; every
    query keeps its own key so that no row is fully masked (which would give NaN).
    """
    starts = None
    if position_ids is not None:
        starts = torch.zeros_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        if not bool(starts.any()):
            starts = None
    padded = attention_mask is not None and not bool(attention_mask.all())
    if starts is None and not padded:
        return None
    if not padded:
        return DocumentSpans.from_starts(starts)
    assert attention_mask is not None
    real = attention_mask.bool()
    if starts is not None and not bool((real[:, 1:] & ~real[:, :-1]).any()):  # right padding
        return DocumentSpans.from_starts(starts | padding_starts(real))
    return padded_mask(starts, attention_mask)


def padding_starts(real: torch.Tensor) -> torch.Tensor:
    """True where a right-padded row's padding tail begins (`real`: True on real tokens)."""
    starts = torch.zeros_like(real)
    starts[:, 1:] = real[:, :-1] & ~real[:, 1:]
    return starts


def padded_mask(starts: torch.Tensor | None, attention_mask: torch.Tensor) -> torch.Tensor:
    """The boolean `[B, 1, S, S]` mask of a padded batch (`starts`: where packed documents
    begin, or None)."""
    s = attention_mask.shape[-1]
    device = attention_mask.device
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    mask = causal.expand(attention_mask.shape[0], s, s).clone()
    if starts is not None:
        doc = starts.cumsum(-1)
        mask &= doc[:, :, None] == doc[:, None, :]
    mask &= attention_mask.bool()[:, None, :]
    mask |= torch.eye(s, dtype=torch.bool, device=device)
    return mask[:, None]


class Transformer(nn.Module):
    """Decoder-only language model.

    Parameter names mirror Hugging Face's Llama layout (minus the `model.` prefix), so
    importing and exporting HF checkpoints is a rename, never a permutation.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = make_embedding(config)  # Gemma: scaled by sqrt(hidden_size)
        self.layers = nn.ModuleList(
            BLOCKS[config.norm_position](config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps)
        self.rotary = make_rotary(config)  # Gemma: one table per layer type; LongRoPE: two
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # where this process's head rows lie in the vocabulary (tensor parallelism sets a
        # vocabulary-parallel one); every reduction of the chunked head goes through it
        self.vocab_shard: VocabShard = VocabShard()
        self.gradient_checkpointing = False
        # `model.compile=true` (the factories' `compile=`): LMModule calls `compile_for_training`;
        # the inference engine (packed forwards) always runs the model eagerly
        self.compile_training = False
        self.compiled_call: Callable[..., Any] | None = None
        self.tie_weights()
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    # ------------------------------------------------------------------ parameters
    def tie_weights(self) -> None:
        """Share the output head with the embedding when the config asks for it."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, initializer_range) for matrices, zeros for biases, the identity scale for
        norms (ones; zeros for Gemma's 1 + w)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, MoE):
                module.reset_parameters(std, generator)
            elif isinstance(module, Attention) and module.sinks is not None:
                module.sinks.normal_(0.0, std, generator=generator)  # as transformers' GPT-OSS

    def router_stats(self) -> list[RouterStats]:
        """Per MoE layer: load-balancing loss, z-loss and tokens per expert of the latest
        training forward (empty for a dense model)."""
        return router_stats(self)

    def moe_aux_loss(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(load-balancing loss, router z-loss) of the latest training forward, each the mean
        over MoE layers; None for a dense model or before any training forward."""
        return router_losses(self)

    def compile_for_training(self, **kwargs: Any) -> None:
        """torch.compile this model's calls made with gradients enabled (training steps);
        calls without (validation, reference log-probs) stay eager: Inductor's CPU lowering
        of no-grad graphs fails on this model (torch 2.13), and such calls are rare."""
        self.compiled_call = torch.compile(self._call_impl, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled_call is not None and torch.is_grad_enabled():
            return self.compiled_call(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Unique parameters (a tied head counts once); works on the meta device."""
        params = {id(p): p for p in self.parameters() if p.requires_grad or not trainable_only}
        return sum(p.numel() for p in params.values())

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        return_hidden: bool = False,
        targets: torch.Tensor | None = None,
        head: HeadSettings | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor | TokenScores:
        """Logits `[B, S, vocab]` for dense `[B, S]` ids.

        `position_ids` may restart inside a row (packed documents); attention then stays
        within each document. `attention_mask` is 1 for real tokens, 0 for padding.
        `cu_seqlens` (packed windows' collate: int32 document starts over the flattened
        `B * S` tokens, then `B * S`) gives the documents without reading the position ids.

        `targets` (`[B, S]` vocabulary ids, `IGNORE_INDEX` where no score is needed): instead
        of logits, the `TokenScores` `[B, S]` of the chunked head (`astrai.model.head`, with
        `head`'s settings; default `HeadSettings()`): per-token log-probs of the targets (and
        entropy / label smoothing's term when asked), never the full logits; only the targeted
        positions go through the head. Here, inside forward, so FSDP2's hooks apply.
        """
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids: expected shape [batch, seq], got {tuple(input_ids.shape)}"
            )
        b, s = input_ids.shape
        if position_ids is None:
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        else:
            if position_ids.shape != input_ids.shape:
                raise ValueError(
                    f"position_ids: shape {tuple(position_ids.shape)} does not match "
                    f"input_ids {tuple(input_ids.shape)}"
                )
            positions = position_ids
        mask = (
            document_mask(position_ids, attention_mask)
            if cu_seqlens is None
            else DocumentSpans.from_cu_seqlens(cu_seqlens, b, s)
        )
        # default positions end at s - 1: no device sync (and no torch.compile graph break)
        tables = self.rotary.layer_tables(positions, s - 1 if position_ids is None else None)
        x = self.embed_tokens(input_ids)
        for layer, (cos, sin) in zip(self.layers, tables):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        x = self.norm(x)
        if targets is not None:
            return self.token_scores(x, targets, head if head is not None else HeadSettings())
        return x if return_hidden else self.lm_head(x)

    def token_scores(
        self, hidden: torch.Tensor, targets: torch.Tensor, head: HeadSettings
    ) -> TokenScores:
        """`TokenScores` `[B, S]` of final-normed `hidden` `[B, S, D]` at `targets` (see
        `forward`), through `lm_head` (a LoRA-wrapped head included) and `vocab_shard`."""
        if targets.shape != hidden.shape[:-1]:
            raise ValueError(
                f"targets: shape {tuple(targets.shape)} does not match the tokens "
                f"{tuple(hidden.shape[:-1])}"
            )
        return head_scores(self.lm_head, hidden, targets, head, self.vocab_shard)

    def hidden_packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        max_position: int | None = None,
        *,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states `[T, hidden]` of packed `[T]` tokens (only the rows
        `indices`, when given), writing every new token's K/V to `kv_cache`.

        `lm_head` of a row gives its logits; the engine's prompt log-probs apply it to slices
        of these rows, so the full-vocabulary logits of a whole prefill never exist at once.
        """
        tables = self.rotary.layer_tables(positions, max_position, per_token=True)
        x = self.embed_tokens(input_ids)
        for layer, (cos, sin) in zip(self.layers, tables):
            x = layer.forward_cached(x, cos, sin, kv_cache)
        if indices is not None:
            x = x[indices]
        return self.norm(x)

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        logits_indices: torch.Tensor | None = None,
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Inference forward over packed `[T]` tokens of many requests (prefill, extend, decode).

        K/V of every new token are written to `kv_cache`; logits are computed only for
        `logits_indices` (the rows that sample), which keeps the vocab projection cheap.
        `max_position` bounds `positions` from the host, so nothing waits for the device.
        """
        hidden = self.hidden_packed(
            input_ids, positions, kv_cache, max_position, indices=logits_indices
        )
        return self.lm_head(hidden)
