"""`python -m astrai.train.plan_table`: the markdown table of docs/scaling.md ("Which size
fits where"), from the memory plan (`astrai.train.memory_plan`), so the docs can be
regenerated.

experiment=grpo_8b's workload (gradient checkpointing, bf16-mixed, a bf16 reference, a
65,536-token KV pool without packed projections, AdamW, one group of 16 rollouts x 4,096
tokens per micro-batch) for several model shapes and layouts, on 1 x 24 GiB, 1 x 80 GiB and
8 x 80 GiB devices. "budget": GRPO's packed forwards of at most 8,192 tokens
(`padding_free`, `use_dynamic_bsz`, `ppo_max_token_len_per_gpu`); "sleep": the engine's KV
pool and packs released from each rollout to the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from astrai.model.config import ModelConfig, preset
from astrai.train.memory_plan import GIB, Layout, MemoryPlan, Workload, plan_memory
from astrai.train.memory_plan_config import layout_of, workload_of

__all__ = ["LAYOUTS", "SHAPES", "markdown_table"]

#: model shapes of the table: presets, and Qwen3's 1.7B and 4B shapes (their config.json)
SHAPES: dict[str, ModelConfig] = {
    "astrai-1b": preset("astrai-1b"),
    "Qwen3-1.7B shape": preset(
        "qwen3-8b",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen3-4B shape": preset(
        "qwen3-8b", hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True
    ),
    "Qwen3-8B (grpo_8b)": preset("qwen3-8b"),
}
#: layout name -> (FSDP2, LM head chunk (None: dense), GRPO token budget per forward, sleep)
LAYOUTS: dict[str, tuple[bool, int | None, int | None, bool]] = {
    "DDP, dense head": (False, None, None, False),
    "DDP, chunked head, budget, sleep": (False, 1024, 8192, True),
    "FSDP2, dense head": (True, None, None, False),
    "FSDP2, chunked head": (True, 1024, None, False),
    "FSDP2, chunked head, budget": (True, 1024, 8192, False),
    "FSDP2, chunked head, budget, sleep": (True, 1024, 8192, True),
}
DEVICES = ((1, 24), (1, 80), (8, 80))


def _recipe() -> tuple[Layout, Workload]:
    from astrai.train.runner import compose

    cfg = compose(["experiment=grpo_8b", "model=qwen3-8b"])
    return layout_of(cfg), workload_of(cfg, preset("qwen3-8b"), None)


def plan(model: ModelConfig, layout: Layout, work: Workload, name: str, ranks: int) -> MemoryPlan:
    """One cell's plan: `layout` and `work` as the table's column and row name them."""
    sharded, chunk, budget, sleep = LAYOUTS[name]
    engine = dataclasses.replace(work.engine, sleep=sleep) if work.engine else None
    work = dataclasses.replace(work, logits_chunk_size=chunk, forward_tokens=budget, engine=engine)
    lay = dataclasses.replace(
        layout,
        world_size=ranks,
        fully_sharded=sharded,
        shard_bytes=layout.shard_bytes if sharded else None,
    )
    return plan_memory(model, lay, work)


def _cell(p: MemoryPlan, gib: int) -> str:
    mark = "fits" if p.fits(gib * GIB) else "no"
    return f"{p.peak / GIB:.0f} ({mark})"


def markdown_table(shapes: Sequence[str] = tuple(SHAPES)) -> str:
    """Peak GiB per device (and whether it fits) per shape, layout and device set, for
    grpo_8b's workload."""
    layout, work = _recipe()
    head = [f"{n} x {g} GiB" for n, g in DEVICES]
    lines = [
        "| model | parameters | layout | " + " | ".join(head) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in head) + " |",
    ]
    for shape in shapes:
        model = SHAPES[shape]
        for name, (sharded, *_) in LAYOUTS.items():
            cells = []
            for ranks, gib in DEVICES:
                if sharded and ranks == 1:
                    cells.append("-")
                    continue
                cells.append(_cell(plan(model, layout, work, name, ranks), gib))
            params = f"{model.num_parameters() / 1e9:.2f}B"
            lines.append(f"| {shape} | {params} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # the table is the command's output (markdown on stdout)
    import sys

    sys.stdout.write(markdown_table() + "\n")
