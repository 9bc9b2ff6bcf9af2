"""Chunked LM head benchmark: peak memory and step time of SFT and GRPO training steps, the
chunked head (``strategy.logits_chunk_size``) against the full logits (``null``), over
vocabulary sizes.

Each configuration (strategy x vocabulary x head) runs in a fresh process (this module's
``__main__``): the strategy's real module (``SFTModule`` / ``GRPOModule``, kl_coef > 0 so the
reference pass runs, the entropy metric too; GRPO's rollouts from a canned source of fixed
completions) on ``hardware=cpu_smoke``'s model size (astrai-1b's family: tied embeddings,
hidden 64, 2 layers), ``warmup + steps`` steps of ``compute_loss``, backward and an AdamW
step. The parent reads the child's peak RSS (``ru_maxrss`` of ``os.wait4``).

What the head costs is the *vocabulary-dependent excess*: the peak at vocabulary ``V`` minus
the peak of the same process on a 2-token batch at ``V`` (which holds the vocabulary's own
weights, gradients, optimizer state and the optimizer's temporaries, and almost no logits),
minus the same difference at the smallest vocabulary. The target is an excess of at most
1/8 of the dense logits' size (fp32 ``tokens x V``), flat in ``V``; and a chunked step
within 10% of a dense one (median step times, same shapes).

    python -m astrai.bench chunked_loss out=experiments/bench/chunked-loss-cpu.json
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from astrai.bench.common import as_list

log = logging.getLogger(__name__)

#: hardware=cpu_smoke's model (conf/hardware/cpu_smoke.yaml) on the astrai-1b preset
SMOKE_MODEL: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)
STRATEGIES = ("sft", "grpo")
HEADS = ("chunked", "dense")


# ---------------------------------------------------------------------- the child process
def _sft(spec: Mapping[str, Any], model: Any, chunk: int | None) -> tuple[Any, dict[str, Any]]:
    import torch

    from astrai.data.datasets import IGNORE_INDEX
    from astrai.train.strategies.sft import SFTModule

    rows, tokens = spec["shape"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["vocab_size"], (rows, tokens), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, : tokens // 8] = IGNORE_INDEX  # a prompt
    labels[:, -1] = IGNORE_INDEX
    module = SFTModule(model=model, logits_chunk_size=chunk)
    return module, {"input_ids": ids, "labels": labels}


def _grpo(spec: Mapping[str, Any], model: Any, chunk: int | None) -> tuple[Any, dict[str, Any]]:
    import torch

    from astrai.train.strategies.grpo import GRPOModule
    from astrai.train.strategies.grpo.sampling import Samples
    from astrai.train.strategies.grpo.source import RolloutSource

    rows, tokens = spec["shape"]
    prompt_len = max(1, min(spec["grpo_prompt_tokens"], tokens - 1))
    completion = tokens - prompt_len
    group = spec["num_generations"]
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 300, (prompt_len,), generator=g).tolist() for _ in range(rows // group)
    ]
    completions = [
        torch.randint(3, spec["vocab_size"], (completion,), generator=g).tolist()
        for _ in range(rows)
    ]
    samples = Samples(
        prompts=[p for p in prompts for _ in range(group)],
        completions=completions,
        logprobs=[[-5.0] * completion for _ in range(rows)],
        truncated=[False] * rows,
        rewards=torch.rand(rows, generator=g).tolist(),
    )

    class Canned(RolloutSource):
        """The same completions for every batch: the step, not the sampling, is measured."""

        def take(self, batch: Mapping[str, Any], seed: int, step: int) -> Samples:
            return samples

    module = GRPOModule(
        model=model,
        tokenizer=spec["tokenizer"],
        logits_chunk_size=chunk,
        num_generations=group,
        max_new_tokens=completion,
        temperature=spec["grpo_temperature"],
        kl_coef=0.04,
        rewards=[{"name": "format", "weight": 1.0}],
    )
    module.wrap_source(lambda _: Canned())
    return module, {"prompt_ids": prompts, "records": [{}] * len(prompts)}


def child(spec: Mapping[str, Any]) -> dict[str, Any]:
    """One configuration's steps in this process: the step times (s)."""
    import torch

    from astrai.model import preset_model

    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(0)
    model = preset_model("astrai-1b", vocab_size=spec["vocab_size"], **SMOKE_MODEL)
    chunk = spec["logits_chunk_size"] if spec["head"] == "chunked" else None
    build = _sft if spec["strategy"] == "sft" else _grpo
    module, batch = build(spec, model, chunk)
    optimizer = module.configure_optimizers()["optimizer"]
    times = []
    for _ in range(spec["warmup"] + spec["steps"]):
        started = time.perf_counter()
        loss, _ = module.compute_loss(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return {"step_seconds": times[spec["warmup"] :], "loss": float(loss)}


# ---------------------------------------------------------------------- the parent
def _run_child(spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run one configuration in a fresh process; its report and peak RSS (MB)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(spec["threads"]),
        "WANDB_MODE": "disabled",
        # glibc: blocks of 1 MiB and more are mapped and unmapped at free (a fixed threshold,
        # not the adaptive one), so the peak RSS is that of live tensors, not of the heap's
        # high-water mark after fragmentation (the same for every configuration)
        "MALLOC_MMAP_THRESHOLD_": str(2**20),
    }
    out, err = tmp / "child.out", tmp / "child.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "astrai.bench.chunked_loss", json.dumps(spec)],
            stdout=stdout,
            stderr=stderr,
            env=env,
        )
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here: its own rusage
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"chunked_loss child {spec} failed:\n{err.read_text()[-3000:]}")
    result = json.loads(out.read_text().strip().splitlines()[-1])
    result["peak_rss_mb"] = usage.ru_maxrss / 1024  # Linux: kilobytes
    return result


def _tokenizer(root: Path) -> str:
    from astrai.tokenizer import AutoTokenizer

    texts = [f"the answer is {i} and {i * 7} or {i * 13}." for i in range(400)]
    AutoTokenizer.train(texts, vocab_size=300).save_pretrained(root / "tok")
    return str(root / "tok")


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    strategies = [str(s) for s in as_list(cfg["strategies"])]
    heads = [str(h) for h in as_list(cfg["heads"])]
    vocabs = sorted(int(v) for v in as_list(cfg["vocab_sizes"]))
    if bad := [s for s in strategies if s not in STRATEGIES] + [h for h in heads if h not in HEADS]:
        raise ValueError(f"unknown {bad}: strategies are {STRATEGIES}, heads {HEADS}")
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tok = _tokenizer(Path(tmp)) if "grpo" in strategies else ""
        for strategy in strategies:
            shape = [int(x) for x in cfg[f"{strategy}_shape"]]
            small = [shape[0], 2]  # the baseline: the vocabulary's own memory, ~no logits
            for vocab in vocabs:
                for head in heads:
                    spec = {
                        "strategy": strategy,
                        "head": head,
                        "vocab_size": vocab,
                        "logits_chunk_size": int(cfg["logits_chunk_size"]),
                        "threads": int(cfg["threads"]),
                        "num_generations": int(cfg["num_generations"]),
                        "grpo_prompt_tokens": int(cfg["grpo_prompt_tokens"]),
                        "grpo_temperature": float(cfg["grpo_temperature"]),
                        "tokenizer": tok,
                    }
                    timed = {"steps": cfg["steps"], "warmup": cfg["warmup"]}
                    big = _run_child({**spec, "shape": shape, **timed}, Path(tmp))
                    base = _run_child({**spec, "shape": small, "steps": 1, "warmup": 0}, Path(tmp))
                    row = {
                        **{k: spec[k] for k in ("strategy", "head", "vocab_size")},
                        "shape": shape,
                        "peak_rss_mb": big["peak_rss_mb"],
                        "baseline_rss_mb": base["peak_rss_mb"],
                        "median_step_s": statistics.median(big["step_seconds"]),
                        "step_seconds": big["step_seconds"],
                        "dense_logits_mb": shape[0] * shape[1] * vocab * 4 / 2**20,
                    }
                    rows.append(row)
                    log.info("%s", row)
    _excess(rows)
    return {"config": cfg, "load": [load_before, os.getloadavg()], "rows": rows}


def _excess(rows: list[dict[str, Any]]) -> None:
    """Each row's vocabulary-dependent excess (module docstring) and its ratio to the dense
    logits' size; the chunked step time over the dense one."""

    def key(r: dict[str, Any]) -> tuple[str, str]:
        return r["strategy"], r["head"]

    smallest = {}
    for r in rows:
        if key(r) not in smallest or r["vocab_size"] < smallest[key(r)]["vocab_size"]:
            smallest[key(r)] = r
    for r in rows:
        s = smallest[key(r)]
        excess = (r["peak_rss_mb"] - r["baseline_rss_mb"]) - (
            s["peak_rss_mb"] - s["baseline_rss_mb"]
        )
        r["excess_mb"] = excess
        r["excess_over_logits"] = excess / r["dense_logits_mb"] if r is not s else 0.0
    dense = {(r["strategy"], r["vocab_size"]): r for r in rows if r["head"] == "dense"}
    for r in rows:
        d = dense.get((r["strategy"], r["vocab_size"]))
        if r["head"] == "chunked" and d is not None:
            r["step_time_over_dense"] = r["median_step_s"] / d["median_step_s"]


def format_report(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"chunked LM head: chunk {c['logits_chunk_size']} tokens, {c['threads']} thread(s), "
        f"{c['steps']} timed steps; load {report['load'][0][0]:.2f} -> {report['load'][1][0]:.2f}",
        f"{'strategy':<6} {'head':<8} {'vocab':>7} {'peak MB':>8} {'excess MB':>9} "
        f"{'/logits':>8} {'s/step':>7} {'/dense':>7}",
    ]
    for r in report["rows"]:
        ratio = r.get("step_time_over_dense")
        lines.append(
            f"{r['strategy']:<6} {r['head']:<8} {r['vocab_size']:>7} {r['peak_rss_mb']:>8.0f} "
            f"{r['excess_mb']:>9.0f} {r['excess_over_logits']:>8.3f} {r['median_step_s']:>7.3f} "
            f"{'' if ratio is None else f'{ratio:.3f}':>7}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
