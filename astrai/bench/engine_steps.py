"""Per-step decode time at fixed batch sizes for `bench engine` (issue #18: "report per-step
time at batch 1, 4, 16, 48"), split into the phases of one engine step, and the FLOP rates of
decode and prefill against a same-run matmul roofline (issue #31).

Method, for each batch size B (``step_batches``), on an engine of its own whose loop thread
is off (``max_batch_size`` = the largest B, as a server sized for it would be):

1. B requests with distinct random prompts of ``prompt_len`` tokens (seeded), greedy, EOS
   ignored, and enough ``max_tokens`` that none ends before the timing does;
2. engine steps until every request has its first token (all prefilled; these steps are
   timed and their plans kept: the prefill), then ``warmup`` more steps (decode graphs
   replay, allocators settle);
3. ``steps`` timed decode steps. Each replicates `InferenceEngine.step` with its public
   parts so that the phases can be timed apart: ``scheduler.schedule()`` (schedule),
   ``runner.run(plan)`` (forward: the model forward and the sampling, which the runner's
   public surface does not separate), ``scheduler.postprocess`` (postprocess) and
   ``scheduler.cleanup()`` (cleanup), between the hand-off's ``begin_step``/``end_step``.
   Every timed plan must be pure decode with exactly B rows; anything else (a pool too small
   for B requests at once, a preemption) is a `RuntimeError` naming B;
4. after the timed steps, with the engine still open (its packed projections in place),
   the roofline: the GEMMs of a B-row decode step alone, and those of each prefill plan
   (its token rows, its sampling rows through the lm_head), timed by
   `astrai.bench.roofline.gemm_roofline` (so none of it runs inside a timed step).

Reported per B: ``step_ms`` (mean wall time of a step), ``tokens_per_s`` (B / step time),
the mean ms of each phase, ``overhead_ms`` (step - forward: everything around the model
and the sampler) and ``overhead_share`` (overhead / step). FLOP rates (`step_flops`: the
plans' projections, the lm_head of the sampling rows, attention over the keys each token
sees, at the context lengths the steps had): ``step_gflop`` (per decode step), ``gflops``
(the timed steps' FLOPs / their wall time), ``matmul_gflops_roofline`` and
``roofline_fraction`` (achieved / roofline); the prefill's ``prefill_tokens``,
``prefill_ms`` (summed over its steps), ``prefill_gflops``,
``prefill_matmul_gflops_roofline`` and ``prefill_roofline_fraction``; and ``peak_gflops``,
one large square GEMM measured once after all runs, for context. With ``repeats`` > 1
every B is measured that many times (alternated over the batch sizes) and the run with the
lowest ``step_ms`` kept, with the prefill figures of the run whose prefill was fastest (the
first prefill of a shape also pays one-time costs, such as oneDNN building its kernels).
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
from astrai.bench.roofline import PEAK_GEMM_SIZE, gemm_roofline, peak_gflops, step_flops
from astrai.inference import InferenceEngine
from astrai.inference.scheduler import StepPlan
from astrai.model import ModelConfig, Transformer
from astrai.tokenizer import AutoTokenizer

PHASES = ("schedule", "forward", "postprocess", "cleanup")
PREFILL_STEP_LIMIT = 64  # steps allowed until every request has its first token


def _run_step(eng: InferenceEngine, batch: int | None) -> tuple[dict[str, float], list[StepPlan]]:
    """One engine step, `InferenceEngine.step`'s sequence, with each phase's seconds and its
    plans; `batch`: the step must be one pure-decode plan of that many rows (None: any)."""
    scheduler, runner, clock = eng.scheduler, eng.runner, time.perf_counter
    took = dict.fromkeys(PHASES, 0.0)
    start = clock()
    eng.handoff.begin_step()
    milestones = scheduler.milestones
    try:
        t0 = clock()
        plans = list(scheduler.schedule())
        took["schedule"] = clock() - t0
        if batch is not None and (
            len(plans) != 1 or not plans[0].decode_only or len(plans[0].rows) != batch
        ):
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
            scheduler.postprocess(plan, out)
            took["forward"] += t1 - t0
            took["postprocess"] += clock() - t1
        t0 = clock()
        scheduler.cleanup()
        took["cleanup"] = clock() - t0
    finally:
        eng.handoff.end_step(urgent=scheduler.milestones != milestones)
    took["step"] = clock() - start
    return took, plans


def _timed_step(eng: InferenceEngine, config: ModelConfig, batch: int | None) -> dict[str, Any]:
    """`_run_step`'s seconds, the step's FLOPs (`step_flops` of each plan, counted after the
    clock stopped) and its plans' (token rows, sampling rows), the roofline's shapes."""
    took, plans = _run_step(eng, batch)
    flops = [step_flops(config, p.q_lens, p.seq_lens, len(p.sample_rows)) for p in plans]
    return {
        **took,
        "flops": sum(f["total"] for f in flops),
        "gemm_rows": [(sum(p.q_lens), len(p.sample_rows)) for p in plans],
    }


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
        prefill = []  # the steps until every request has its first token
        for _ in range(PREFILL_STEP_LIMIT):
            if all(t.first_token_at is not None for t in tasks):
                break
            prefill.append(_timed_step(eng, model.config, None))
        if any(t.first_token_at is None or t.finished for t in tasks):
            ended = [f"{t.finish_reason}: {t.error}" for t in tasks if t.finished] or ["none"]
            raise RuntimeError(
                f"batch {batch}: the {batch} requests were not all prefilled and running "
                f"after {PREFILL_STEP_LIMIT} steps (ended early: {ended[0]}); is the KV pool "
                f"too small for {batch} requests at once?"
            )
        for _ in range(warmup):
            eng.step()
        timed = [_timed_step(eng, model.config, batch) for _ in range(steps)]
        ended = [f"{t.finish_reason}: {t.error}" for t in tasks if t.finished]
        if ended:
            raise RuntimeError(f"batch {batch}: a request ended during the timed steps: {ended[0]}")
        # after the timed steps, while the engine still holds what it gave the model for
        # inference (packed projections): the GEMMs the rates are read against
        rates = {**_decode_rates(model, batch, timed), **_prefill_rates(model, prefill)}
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
    return {**out, **rates}


def _decode_rates(model: Transformer, batch: int, timed: list[dict[str, Any]]) -> dict[str, Any]:
    """Decode FLOP/s (the timed steps' FLOPs at their context lengths / their time) against
    the GEMMs of a `batch`-row decode step alone."""
    flops, seconds = sum(t["flops"] for t in timed), sum(t["step"] for t in timed)
    achieved = flops / seconds / 1e9
    roof = gemm_roofline(model, batch, batch)["gflops"]
    return {
        "step_gflop": flops / len(timed) / 1e9,
        "gflops": achieved,
        "matmul_gflops_roofline": roof,
        "roofline_fraction": achieved / roof,
    }


PREFILL_KEYS = (
    "prefill_steps",
    "prefill_tokens",
    "prefill_ms",
    "prefill_gflops",
    "prefill_matmul_gflops_roofline",
    "prefill_roofline_fraction",
)


def _prefill_rates(model: Transformer, prefill: list[dict[str, Any]]) -> dict[str, Any]:
    """Prefill FLOP/s (the prefill steps' FLOPs / their time) against the GEMMs of those
    steps' plans alone (each plan's token rows, its sampling rows through the lm_head)."""
    flops, seconds = sum(t["flops"] for t in prefill), sum(t["step"] for t in prefill)
    shapes = [rows for t in prefill for rows in t["gemm_rows"] if rows[0]]
    if not shapes:  # nothing was prefilled (cannot happen on a fresh engine)
        return dict.fromkeys(PREFILL_KEYS)
    measured = {s: gemm_roofline(model, *s) for s in set(shapes)}
    roof_flops = sum(measured[s]["flops"] for s in shapes)
    roof = roof_flops / sum(measured[s]["seconds"] for s in shapes) / 1e9
    achieved = flops / seconds / 1e9
    values = (len(prefill), sum(s[0] for s in shapes), seconds * 1e3, achieved, roof)
    return dict(zip(PREFILL_KEYS, (*values, achieved / roof), strict=True))


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
    weight = next(model.parameters())
    peak = peak_gflops(weight.device, weight.dtype)  # after the runs: none of them pays for it
    return {
        "prompt_len": prompt_len,
        "timed_steps": steps,
        "repeats": repeats,
        "peak_gflops": peak,
        "batches": [{**_best(runs[b]), "peak_gflops": peak} for b in batches],
    }


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the lowest decode step time, with the prefill figures of the run whose
    prefill was fastest (the first run's prefill also pays for first-call costs, such as
    oneDNN building its kernels for new shapes)."""
    out = dict(min(runs, key=lambda r: r["step_ms"]))
    fastest = max(runs, key=lambda r: r["prefill_gflops"] or 0.0)
    out.update({k: v for k, v in fastest.items() if k.startswith("prefill_")})
    return out


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
    smallest and the largest; then the FLOP rates of each batch size against the matmul
    roofline (`_format_rates`); [] when there is no report."""
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
    return lines + _format_rates(entries, label)


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _format_rates(entries: Sequence[tuple[str, dict[str, Any]]], label: str) -> list[str]:
    """The FLOP-rate table: one line per report and batch size (none for reports made
    before these figures existed)."""
    rows = [(name, e) for name, r in entries for e in r["batches"] if "gflops" in e]
    if not rows:
        return []
    head = [label, "batch", "decode GFLOP/s", "roofline GFLOP/s", "% roofline"]
    head += ["prefill tokens", "prefill GFLOP/s", "prefill roofline GFLOP/s", "prefill % roofline"]
    head += ["peak GFLOP/s"]
    lines = [
        "",
        "achieved GFLOP/s against a same-run matmul roofline (FLOPs: every projection, the "
        "lm_head of the sampling rows, attention over the keys each token sees; roofline: the "
        f"step's GEMMs alone, same shapes and weights; peak: one {PEAK_GEMM_SIZE}^3 GEMM)",
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for name, e in rows:
        cells = [name, str(e["batch"]), _cell(e["gflops"], ".1f")]
        cells += [_cell(e["matmul_gflops_roofline"], ".1f"), _cell(e["roofline_fraction"], ".0%")]
        cells += [_cell(e["prefill_tokens"], "d"), _cell(e["prefill_gflops"], ".1f")]
        cells += [_cell(e["prefill_matmul_gflops_roofline"], ".1f")]
        cells += [_cell(e["prefill_roofline_fraction"], ".0%"), _cell(e["peak_gflops"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
