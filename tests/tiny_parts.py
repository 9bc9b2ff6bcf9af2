"""The suite's tiny model: one shape (2 layers, 64 wide, grouped-query attention) that the
inference, serve and eval tests build with seed 0, and the text of the 384-token BPE that the
inference and serve tests share (tests/conftest.py's `stdlib_tokenizer`)."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

STDLIB_VOCAB = 384
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.15,  # spread-out logits: greedy has no near-ties
)


#: GPT-OSS's harmony markers and stop tokens (special tokens of a harmony tokenizer)
HARMONY_MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"]
HARMONY_STOPS = ["<|return|>", "<|call|>"]
#: a chat template in the shape of gpt-oss's: a system message with the reasoning effort, a
#: developer message with the tools, calls and tool results on the commentary channel,
#: `<|start|>assistant` as the generation prompt (prefix-stable, for the episode runner)
HARMONY_TEMPLATE = """
{%- set ns = namespace(tool="") -%}
{{- "<|start|>system<|message|>Reasoning: " + (reasoning_effort | default("medium")) -}}
{{- "\\n# Valid channels: analysis, commentary, final.<|end|>" -}}
{%- if tools -%}
  {{- "<|start|>developer<|message|># Tools\\nnamespace functions {\\n" -}}
  {%- for t in tools -%}{{- "type " + t.function.name + " = (_: any) => any;\\n" -}}{%- endfor -%}
  {{- "}<|end|>" -}}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == "assistant" and m.tool_calls -%}
    {%- for c in m.tool_calls -%}
      {%- set ns.tool = c.function.name -%}
      {%- set args = c.function.arguments -%}
      {{- "<|start|>assistant to=functions." + c.function.name -}}
      {{- "<|channel|>commentary json<|message|>" -}}
      {{- (args if args is string else args | tojson) + "<|call|>" -}}
    {%- endfor -%}
  {%- elif m.role == "tool" -%}
    {{- "<|start|>functions." + ns.tool + " to=assistant<|channel|>commentary<|message|>" -}}
    {{- m.content + "<|end|>" -}}
  {%- elif m.role == "assistant" -%}
    {{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" -}}
  {%- else -%}
    {{- "<|start|>" + m.role + "<|message|>" + m.content + "<|end|>" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}
"""


def harmony_tokenizer(
    texts: list[str], vocab_size: int, stops: tuple[str, ...] = tuple(HARMONY_STOPS)
) -> Any:
    """A BPE on `texts` with harmony's markers as special tokens, `stops` as its extra stop
    tokens (gpt-oss's first generation_config.json names only `<|return|>`; the server adds
    `<|call|>` for harmony requests) and `HARMONY_TEMPLATE`."""
    from astrai.tokenizer import AutoTokenizer
    from astrai.tokenizer.tokens import DEFAULT_SPECIAL_TOKENS

    specials = [*DEFAULT_SPECIAL_TOKENS, *HARMONY_MARKERS, *HARMONY_STOPS]
    trained = AutoTokenizer.train(texts, vocab_size=vocab_size, special_tokens=specials)
    return AutoTokenizer(
        trained.backend,
        bos_token=trained.bos_token,
        eos_token=trained.eos_token,
        pad_token=trained.pad_token,
        chat_template=HARMONY_TEMPLATE,
        extra_stop_tokens=list(stops),
    )


def stdlib_texts() -> list[str]:
    """The first ten `[a-c]*.py` files of Python's standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p.read_text(errors="ignore") for p in sorted(stdlib.glob("[a-c]*.py"))[:10]]


def tiny_transformer(vocab_size: int, max_positions: int = 512) -> Any:
    """The tiny shape with random weights from seed 0, in eval mode."""
    import torch

    from astrai.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=vocab_size, max_position_embeddings=max_positions, **TINY_SHAPE)
    torch.manual_seed(0)
    return Transformer(cfg).eval()
