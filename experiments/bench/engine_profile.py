"""Where a decode step's time goes, per matrix row (issue #52): torch's profiler over 30
pure-decode steps of `batch` running requests (prompts of 100-400 tokens, greedy, EOS
ignored), the engine stepped on the calling thread. Prints the share of the step's CPU time
per operator group (matmuls, attention, norms and pointwise, sampling, host/Python work).
Shares, not times, so a loaded machine disturbs them less.

    python experiments/bench/engine_profile.py [row ids ...] [--batch 16]
    ASTR_CPU_KERNELS=0 python experiments/bench/engine_profile.py ...   # torch_native attention
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
import yaml
from torch.profiler import ProfilerActivity, profile

from astrai.bench.common import bench_tokenizer
from astrai.inference import InferenceEngine
from astrai.model import preset_model

GROUPS = {  # first match wins
    "matmul (oneDNN / addmm)": ("mkldnn", "linear", "addmm", "mm", "matmul"),
    "attention": ("paged_attention", "scaled_dot_product", "_flash_attention", "index_select"),
    "kv write": ("index_put",),
    "sampling": ("argmax", "softmax", "exp", "log_softmax", "topk", "sort", "multinomial"),
    "norm / rotary / pointwise": (
        "mul",
        "add",
        "silu",
        "rsqrt",
        "mean",
        "pow",
        "cat",
        "neg",
        "div",
        "sub",
        "sum",
        "copy",
        "to",
        "clone",
        "split",
        "view",
        "empty",
        "select",
        "slice",
        "as_strided",
        "transpose",
        "reshape",
        "narrow",
        "unsqueeze",
        "stack",
        "index",
        "fill",
        "zero",
        "where",
        "contiguous",
        "expand",
    ),
}


def group_of(name: str) -> str:
    op = name.split("::")[-1]
    for group, keys in GROUPS.items():
        if any(op == k or op.startswith(k) or k in name for k in keys):
            return group
    return "other ops"


def profile_row(row: dict, batch: int, steps: int = 30) -> dict[str, float]:
    torch.manual_seed(0)
    model = preset_model(**row["model"]).eval()
    tokenizer = bench_tokenizer(model.config.vocab_size)
    rng = random.Random(0)
    eng = InferenceEngine(model, tokenizer, max_batch_size=batch, max_seq_len=600, start=False)
    vocab = model.config.vocab_size
    for _ in range(batch):
        prompt = [rng.randrange(16, vocab) for _ in range(rng.randint(100, 400))]
        eng.submit(prompt, max_tokens=steps + 60, temperature=0.0, ignore_eos=True)
    for _ in range(40):  # prefill and warm-up
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall = (time.perf_counter() - start) / steps
    eng.shutdown()
    shares: dict[str, float] = defaultdict(float)
    total_ops = 0.0
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep"):
            continue
        shares[group_of(event.key)] += event.self_cpu_time_total
        total_ops += event.self_cpu_time_total
    step_us = wall * 1e6 * steps
    # what the profiler saw in operators vs the wall clock: the rest is Python / host work
    out = {g: v / step_us for g, v in shares.items()}
    out["host (Python, scheduler, not in an op)"] = max(0.0, 1 - total_ops / step_us)
    out["step_ms"] = wall * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rows", nargs="*")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with open("conf/bench/engine_matrix.yaml") as f:
        table = yaml.safe_load(f)["matrices"]["cpu"]
    rows = [r for r in table if not args.rows or r["id"] in args.rows]
    for row in rows:
        shares = profile_row(row, args.batch)
        step = shares.pop("step_ms")
        parts = ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
        print(f"{row['id']} batch {args.batch}: step {step:.2f} ms; {parts}", flush=True)


if __name__ == "__main__":
    main()
