"""Per-step decode time at fixed batch sizes for `bench engine` (issue #18: "report per-step
time at batch 1, 4, 16, 48"), split into the phases of one engine step.

Method, for each batch size B (``step_batches``), on an engine of its own whose loop thread
is off (``max_batch_size`` = the largest B, as a server sized for it would be):

1. B requests with distinct random prompts of ``prompt_len`` tokens (seeded), greedy, EOS
   ignored, and enough ``max_tokens`` that none ends before the timing does;
2. ``engine.step()`` until every request has its first token (all prefilled), then
   ``warmup`` more steps (decode graphs replay, allocators settle);
3. ``steps`` timed decode steps. Each replicates `InferenceEngine.step` with its public
   parts so that the phases can be timed apart: ``scheduler.schedule()`` (schedule),
   ``runner.run(plan)`` (forward: the model forward and the sampling, which the runner's
   public surface does not separate), ``scheduler.postprocess`` (postprocess) and
   ``scheduler.cleanup()`` (cleanup), between the hand-off's ``begin_step``/``end_step``.
   Every timed plan must be pure decode with exactly B rows; anything else (a pool too small
   for B requests at once, a preemption) is a `RuntimeError` naming B.

Reported per B: ``step_ms`` (mean wall time of a step), ``tokens_per_s`` (B / step time),
the mean ms of each phase, ``overhead_ms`` (step - forward: everything around the model
and the sampler) and ``overhead_share`` (overhead / step). With ``repeats`` > 1 every B is
measured that many times (alternated over the batch sizes) and the lowest ``step_ms`` kept.
The runner returns the sampled ids as Python lists, so a CUDA forward has finished when
its phase's clock stops.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from astrai.bench.common import as_list
from astrai.bench.engine_phases import EngineFactory
from astrai.inference import InferenceEngine
from astrai.model import Transformer
from astrai.tokenizer import AutoTokenizer

PHASES = ("schedule", "forward", "postprocess", "cleanup")
PREFILL_STEP_LIMIT = 64  # steps allowed until every request has its first token


def _timed_step(eng: InferenceEngine, batch: int) -> dict[str, float]:
    """One engine step, `InferenceEngine.step`'s sequence, with each phase's seconds."""
    scheduler, runner, clock = eng.scheduler, eng.runner, time.perf_counter
    took = dict.fromkeys(PHASES, 0.0)
    start = clock()
    eng.handoff.begin_step()
    milestones = scheduler.milestones
    try:
        t0 = clock()
        plans = list(scheduler.schedule())
        took["schedule"] = clock() - t0
        if len(plans) != 1 or not plans[0].decode_only or len(plans[0].rows) != batch:
            shape = [(len(p.rows), p.decode_only) for p in plans]
            raise RuntimeError(
                f"batch {batch}: a timed step is not one pure-decode plan of {batch} rows "
                f"(plans as (rows, decode_only): {shape}); is the KV pool too small for "
                f"{batch} requests at once?"
            )
        for plan in plans:
            t0 = clock()
            out = runner.run(plan)
            t1 = clock()
            scheduler.postprocess(plan, *out)
            took["forward"] += t1 - t0
            took["postprocess"] += clock() - t1
        t0 = clock()
        scheduler.cleanup()
        took["cleanup"] = clock() - t0
    finally:
        eng.handoff.end_step(urgent=scheduler.milestones != milestones)
    took["step"] = clock() - start
    return took


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def measure_batch(
    engine: EngineFactory,
    model: Transformer,
    tokenizer: AutoTokenizer,
    batch: int,
    steps: int,
    *,
    prompt_len: int = 32,
    warmup: int = 3,
    seed: int = 0,
    **engine_kw: Any,
) -> dict[str, Any]:
    """`steps` timed decode steps of `batch` running requests (see the module docstring)."""
    max_tokens = PREFILL_STEP_LIMIT + warmup + steps + 1
    engine_kw.setdefault("max_batch_size", batch)
    engine_kw.setdefault("max_seq_len", prompt_len + max_tokens + 1)
    prompts = _prompts(batch, prompt_len, model.config.vocab_size, seed)
    with engine(model, tokenizer, start=False, **engine_kw) as eng:
        results = [
            eng.submit(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for p in prompts
        ]
        tasks = [r.task for r in results]
        for _ in range(PREFILL_STEP_LIMIT):
            if all(t.first_token_at is not None for t in tasks):
                break
            eng.step()
        if any(t.first_token_at is None or t.finished for t in tasks):
            ended = [f"{t.finish_reason}: {t.error}" for t in tasks if t.finished] or ["none"]
            raise RuntimeError(
                f"batch {batch}: the {batch} requests were not all prefilled and running "
                f"after {PREFILL_STEP_LIMIT} steps (ended early: {ended[0]}); is the KV pool "
                f"too small for {batch} requests at once?"
            )
        for _ in range(warmup):
            eng.step()
        timed = [_timed_step(eng, batch) for _ in range(steps)]
        ended = [f"{t.finish_reason}: {t.error}" for t in tasks if t.finished]
        if ended:
            raise RuntimeError(f"batch {batch}: a request ended during the timed steps: {ended[0]}")
    step_s = sum(t["step"] for t in timed) / steps
    forward_s = sum(t["forward"] for t in timed) / steps
    out: dict[str, Any] = {
        "batch": batch,
        "step_ms": step_s * 1e3,
        "tokens_per_s": batch / step_s,
    }
    for phase in PHASES:
        out[f"{phase}_ms"] = sum(t[phase] for t in timed) / steps * 1e3
    out["overhead_ms"] = (step_s - forward_s) * 1e3
    out["overhead_share"] = (step_s - forward_s) / step_s
    return out


def decode_steps(
    engine: EngineFactory,
    model: Transformer,
    tokenizer: AutoTokenizer,
    batches: Sequence[int],
    steps: int,
    *,
    repeats: int = 1,
    prompt_len: int = 32,
    warmup: int = 3,
    seed: int = 0,
    **engine_kw: Any,
) -> dict[str, Any]:
    """Per-step decode time and its phases at each batch size of `batches`, the best
    (lowest step time) of `repeats` runs each; `engine_kw` go to every engine."""
    batches = [int(b) for b in batches]
    if not batches or min(batches) <= 0 or steps <= 0 or repeats <= 0:
        raise ValueError(
            f"decode_steps: batches must be positive and steps, repeats > 0; got "
            f"batches={batches}, steps={steps}, repeats={repeats}"
        )
    engine_kw.setdefault("max_batch_size", max(batches))
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in batches}
    for _ in range(repeats):  # alternated, so that a slow spell of the machine hits all
        for b in batches:
            runs[b].append(
                measure_batch(
                    engine,
                    model,
                    tokenizer,
                    b,
                    steps,
                    prompt_len=prompt_len,
                    warmup=warmup,
                    seed=seed + b,
                    **engine_kw,
                )
            )
    return {
        "prompt_len": prompt_len,
        "timed_steps": steps,
        "repeats": repeats,
        "batches": [min(runs[b], key=lambda r: r["step_ms"]) for b in batches],
    }


def run_steps(
    cfg: dict[str, Any],
    engine: EngineFactory,
    model: Transformer,
    tokenizer: AutoTokenizer,
    **engine_kw: Any,
) -> dict[str, Any] | None:
    """`decode_steps` at the benchmark's `step_batches` (None or []: skipped, None returned)
    with its `step_count`, `repeats` and `seed`."""
    sizes = [] if cfg["step_batches"] is None else as_list(cfg["step_batches"])
    if not sizes:
        return None
    return decode_steps(
        engine,
        model,
        tokenizer,
        sizes,
        int(cfg["step_count"]),
        repeats=int(cfg["repeats"]),
        seed=int(cfg["seed"]),
        **engine_kw,
    )


def format_steps(
    entries: Sequence[tuple[str, dict[str, Any] | None]], label: str = "model"
) -> list[str]:
    """A titled Markdown table of `decode_steps` reports, one line per `(name, report)`
    (None: skipped): step ms at each batch size, tokens/s at the largest, and the share of
    the step spent outside the forward (schedule, postprocess, cleanup, hand-off) at the
    smallest and the largest; [] when there is no report."""
    entries = [(name, report) for name, report in entries if report]
    if not entries:
        return []
    first = entries[0][1]
    sizes = [e["batch"] for e in first["batches"]]
    lo, hi = sizes[0], sizes[-1]
    head = [label] + [f"step ms @{b}" for b in sizes] + [f"tok/s @{hi}"]
    shares = [lo, hi] if lo != hi else [lo]
    head += [f"non-forward share @{lo}"] + [f"@{b}" for b in shares[1:]]
    lines = [
        "",
        f"decode step time (mean of {first['timed_steps']} steps, {first['prompt_len']}-token "
        "prompts; non-forward: schedule + postprocess + cleanup + hand-off)",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for name, report in entries:
        by = {e["batch"]: e for e in report["batches"]}
        cells = [name] + [f"{by[b]['step_ms']:.2f}" if b in by else "-" for b in sizes]
        cells.append(f"{by[hi]['tokens_per_s']:.0f}" if hi in by else "-")
        cells += [f"{by[b]['overhead_share']:.0%}" if b in by else "-" for b in shares]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
