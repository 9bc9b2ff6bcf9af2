"""Training benchmark: astrai's training step vs a plain PyTorch loop on the same work.

The astrai side is the real path: the strategy LightningModule (`conf/strategy/pretrain.yaml`,
built by the training entry point's `instantiate_strategy`), its optimizer and schedule from
the `optim` group, and a Lightning `Trainer` with the recipe's gradient clipping
(`conf/trainer/default.yaml`). So every step pays what a recipe's step pays: `training_step`
with its finite-loss check, `self.log` of the loss and token count, the per-step gradient
statistics (`on_before_optimizer_step`), clipping, the LR scheduler, and Lightning's loop,
logger connector and CSV logger writing every `log_every_n_steps` (5, as the recipe).
Left out, because they are not the step: the progress bar (terminal output), checkpointing
and exports (disk I/O every 50 steps), validation, and the throughput / LR monitors.

The plain side is what one would write by hand: the same model (same factory, same seed),
the same pre-made batches through a `DataLoader`, `F.cross_entropy`, `clip_grad_norm_`,
`torch.optim.AdamW` with the same settings and decay groups (built here, not by astrai's
builder), a `LambdaLR` over the same schedule multiplier, and a mixture of experts' router
losses as the strategy adds them. Both sides run `warmup_steps` untimed steps, then `steps`
timed ones; the benchmark adds no GPU synchronisation inside the timed steps (it waits once
at their start and end; the framework's own checks do wait), and both sides keep every
step's loss, which must agree: the two measure the same work. `repeats` alternates the
sides (which one runs first alternates too) and keeps each one's best run. Besides the
tokens/s ratio of the best runs (the target), the report gives the median of the ratios
of each repeat's two (adjacent) runs, the ratio of median step times and that of the
process's CPU time, which a busy shared machine disturbs less.

MFU is model FLOPs (PaLM appendix B: `6 N + 12 L H T` per token, N the parameters that
multiply: all but the input embedding table, and the inactive experts of a MoE) x tokens/s
over the device's peak: on CPU a large fp32 matmul measured in the same run (so 100% is
what this machine reaches on a matmul), on CUDA the datasheet's dense figure
(`PEAK_TFLOPS`), or `peak_tflops` when given. On CPU, `mfu_cpu_time` also divides by the
process's CPU time and the matmul's peak per CPU-second: what an idle machine would show.
`model.compile=true` compiles both sides' forward with torch.compile
(`LMModule.configure_model` on the astrai side).
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DataLoader

from astrai.bench.common import model_name
from astrai.model import Transformer
from astrai.model.moe import inactive_expert_parameters
from astrai.train.runner import instantiate_strategy

logger = logging.getLogger(__name__)

#: Dense peak TFLOP/s by GPU name fragment and compute dtype (datasheets, SXM parts; fp32
#: is the non-tensor-core rate, which `32-true` uses with TF32 off, PyTorch's default).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4, "fp32": 66.9},
    "H100": {"bf16": 989.4, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp32": 19.5},
}
PRECISIONS = ("32-true", "bf16-mixed")
ADAMW = "astrai.train.optim.adamw"


def check_options(cfg: dict[str, Any]) -> None:
    """Bad options are a `SystemExit` naming the option, before any model is built."""
    for key, low in (("batch_size", 1), ("seq_len", 2), ("steps", 2), ("warmup_steps", 1)):
        if int(cfg[key]) < low:
            raise SystemExit(f"option {key}={cfg[key]}: must be >= {low}")
    if int(cfg["repeats"]) < 1:
        raise SystemExit(f"option repeats={cfg['repeats']}: must be >= 1")
    if cfg["precision"] not in PRECISIONS:
        raise SystemExit(f"option precision={cfg['precision']!r}: one of {', '.join(PRECISIONS)}")
    if cfg["optim"].get("_target_") != ADAMW:
        raise SystemExit(
            f"option optim: the plain loop mirrors AdamW ({ADAMW}) only, "
            f"got {cfg['optim'].get('_target_')}"
        )
    device = torch.device(cfg["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"option device={cfg['device']}: no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"option device={cfg['device']}: cpu or cuda")


# ---------------------------------------------------------------------- FLOPs
def flops_per_token(model: Transformer, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: `6 N + 12 L H T` (N: multiplying
    parameters, L layers, H = heads x head_dim, T the sequence length)."""
    config = model.config
    n = model.num_parameters() - inactive_expert_parameters(model)
    if not config.tie_word_embeddings:  # a tied table is the output head's matmul
        n -= model.embed_tokens.weight.numel()
    width = config.num_attention_heads * config.head_dim
    return 6.0 * n + 12.0 * config.num_hidden_layers * width * seq_len


def matmul_flops(
    size: int, dtype: torch.dtype, device: torch.device, repeats: int = 5
) -> tuple[float, float]:
    """FLOP/s of the best of `repeats` square `size` matmuls on `device`: per second of wall
    clock, and per second of this process's CPU time."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    wall = cpu = float("inf")
    for i in range(repeats + 1):
        _sync(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        a @ b
        _sync(device)
        if i:  # the first is a warm-up
            wall = min(wall, time.perf_counter() - start)
            cpu = min(cpu, max(time.process_time() - start_cpu, 1e-9))
    return 2.0 * size**3 / wall, 2.0 * size**3 / cpu


def peak_flops(cfg: dict[str, Any], device: torch.device) -> tuple[float, float | None, str]:
    """The peak FLOP/s MFU divides by, the peak per CPU-second (a measured CPU peak only),
    and where they come from."""
    if cfg["peak_tflops"] is not None:
        return float(cfg["peak_tflops"]) * 1e12, None, "peak_tflops option"
    bf16 = cfg["precision"] == "bf16-mixed"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for part, peaks in PEAK_TFLOPS.items():
            if part in name:
                key = "bf16" if bf16 else "fp32"
                return peaks[key] * 1e12, None, f"{part} {key} dense datasheet"
    dtype = torch.bfloat16 if bf16 else torch.float32
    size = int(cfg["peak_matmul_size"])
    wall, cpu = matmul_flops(size, dtype, device)
    return wall, cpu if device.type == "cpu" else None, f"measured {size}x{size} {dtype} matmul"


# ---------------------------------------------------------------------- the two sides
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(cfg: dict[str, Any], vocab: int) -> list[dict[str, torch.Tensor]]:
    """`warmup_steps + steps` batches of random tokens, labels shifted as the datasets do."""
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    n, b, s = cfg["warmup_steps"] + cfg["steps"], cfg["batch_size"], cfg["seq_len"]
    tokens = torch.randint(0, vocab, (n, b, s + 1), generator=gen)
    return [{"input_ids": t[:, :-1].clone(), "labels": t[:, 1:].clone()} for t in tokens]


def _loader(batches: list[dict[str, torch.Tensor]]) -> DataLoader:
    return DataLoader(batches, batch_size=None, shuffle=False, num_workers=0)


def _result(
    cfg: dict[str, Any],
    stamps: list[float],
    cpu: list[float],
    losses: list[torch.Tensor],
    threads: int,
) -> dict[str, Any]:
    """Timings of the steps after the warm-up: `stamps[i]` is when step i ended (wall
    clock), `cpu[i]` this process's CPU time then."""
    warm = cfg["warmup_steps"]
    steps = [b - a for a, b in zip(stamps[warm - 1 :], stamps[warm:])]
    seconds = stamps[-1] - stamps[warm - 1]
    tokens = len(steps) * cfg["batch_size"] * cfg["seq_len"]
    return {
        "steps": len(steps),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "step_median_s": statistics.median(steps),
        "step_min_s": min(steps),
        "cpu_seconds": cpu[-1] - cpu[warm - 1],
        "losses": [float(x) for x in losses],
        "threads": threads,
    }


class StepClock(L.Callback):
    """When each training step ended (after the optimizer step; wall clock and process CPU
    time), and its loss; `from_first_start`: the first stamp is when the first step began.
    The device syncs before the stamps that bound the timed steps (after `warmup_steps`)."""

    def __init__(
        self, device: torch.device, warmup_steps: int = 0, from_first_start: bool = False
    ) -> None:
        self.warmup_steps, self.device = warmup_steps, device
        self.from_first_start = from_first_start
        self.stamps: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[torch.Tensor] = []

    def _stamp(self) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int
    ) -> None:
        if self.from_first_start and not self.stamps:
            _sync(self.device)
            self._stamp()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if len(self.losses) in (self.warmup_steps - 1, trainer.max_steps - 1):
            _sync(self.device)
        self._stamp()
        self.losses.append(outputs["loss"].detach())


def run_astrai(cfg: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The batches through the strategy LightningModule and a Lightning Trainer."""
    device = torch.device(cfg["device"])
    torch.manual_seed(cfg["seed"])
    module = instantiate_strategy(OmegaConf.create(cfg), None)
    clock = StepClock(device, cfg["warmup_steps"])
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        csv = CSVLogger(tmp, name="bench") if cfg["logger"] else False
        trainer = L.Trainer(
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=[device.index or 0] if device.type == "cuda" else 1,
            precision=cfg["precision"],
            max_steps=len(batches),
            gradient_clip_val=cfg["gradient_clip_val"],
            log_every_n_steps=cfg["log_every_n_steps"],
            logger=csv,
            callbacks=[clock],
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=tmp,
        )
        trainer.fit(module, train_dataloaders=_loader(batches))
    if len(clock.stamps) != len(batches):
        raise RuntimeError(
            f"bench train: Lightning ran {len(clock.stamps)} of {len(batches)} steps"
        )
    return _result(cfg, clock.stamps, clock.cpu, clock.losses, torch.get_num_threads())


def plain_adamw(model: nn.Module, optim: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW as one writes it by hand: decay on the block matrices, `embedding_weight_decay`
    on the embedding / head, none on norms and biases."""
    decay, embed, other = [], [], []
    for name, p in model.named_parameters():
        if "embed" in name or name.startswith("lm_head"):
            embed.append(p)
        elif p.ndim >= 2:
            decay.append(p)
        else:
            other.append(p)
    groups = [
        {"params": decay, "weight_decay": float(optim["weight_decay"])},
        {"params": embed, "weight_decay": float(optim["embedding_weight_decay"])},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=float(optim["lr"]),
        betas=(float(optim["betas"][0]), float(optim["betas"][1])),
        eps=float(optim["eps"]),
        fused=optim["fused"],
    )


def run_plain(cfg: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The batches through a hand-written PyTorch training loop."""
    device = torch.device(cfg["device"])
    torch.manual_seed(cfg["seed"])
    model = instantiate(cfg["model"])().to(device).train()
    if model.compile_training:
        model.compile_for_training()
    opt = plain_adamw(model, cfg["optim"])
    # as `configure_optimizers`: a run length set in the schedule's config wins over max_steps
    total = cfg["optim"]["schedule"].get("total_steps") or len(batches)
    schedule: Callable[[int], float] = instantiate(cfg["optim"]["schedule"])(total_steps=total)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if cfg["precision"] == "bf16-mixed"
        else nullcontext()
    )
    clip = cfg["gradient_clip_val"]
    stamps: list[float] = []
    cpu: list[float] = []
    losses: list[torch.Tensor] = []
    for i, batch in enumerate(_loader(batches)):
        ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        with autocast:
            logits = model(ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        router = model.moe_aux_loss()  # a mixture of experts' balancing terms (None: dense)
        if router is not None:
            aux, z = router
            loss = loss + model.config.router_aux_loss_coef * aux
            loss = loss + model.config.router_z_loss_coef * z
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), float(clip))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if i in (cfg["warmup_steps"] - 1, len(batches) - 1):
            _sync(device)
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        losses.append(loss.detach())
    return _result(cfg, stamps, cpu, losses, torch.get_num_threads())


# ---------------------------------------------------------------------- the benchmark
def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Both sides on the workload of conf/bench/train.yaml, `repeats` times, alternating
    the sides and which of them runs first."""
    check_options(cfg)
    if cfg["threads"]:
        torch.set_num_threads(int(cfg["threads"]))
    device = torch.device(cfg["device"])
    load_before = os.getloadavg()
    model = instantiate(cfg["model"])(device="meta")  # the model's shape, nothing allocated
    per_token = flops_per_token(model, cfg["seq_len"])
    peak, peak_cpu, peak_source = peak_flops(cfg, device)
    batches = make_batches(cfg, model.config.vocab_size)
    runs: dict[str, list[dict[str, Any]]] = {"astrai": [], "plain": []}
    sides = (("astrai", run_astrai), ("plain", run_plain))
    for r in range(cfg["repeats"]):
        # Which side runs first alternates: compiled code's speed drifts within a process.
        for side, fn in sides if r % 2 == 0 else sides[::-1]:
            runs[side].append(fn(cfg, batches))
            gc.collect()  # the run's model and optimizer state go before the next is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
            logger.info("%s run %d: %.0f tokens/s", side, r + 1, runs[side][-1]["tokens_per_s"])
    report: dict[str, Any] = {
        "config": cfg,
        "model": model_name(cfg),
        "parameters": model.num_parameters(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "compile": bool(cfg["model"].get("compile")),
        "flops_per_token": per_token,
        "peak_source": peak_source,
    }
    for side, side_runs in runs.items():
        best = dict(max(side_runs, key=lambda x: x["tokens_per_s"]))
        best["runs_tokens_per_s"] = [x["tokens_per_s"] for x in side_runs]
        best["cpu_seconds_min"] = min(x["cpu_seconds"] for x in side_runs)
        report[side] = best
    report["ratio"] = report["astrai"]["tokens_per_s"] / report["plain"]["tokens_per_s"]
    # each repeat's two runs are adjacent in time, so they share the machine's load of the moment
    pair_ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(*runs.values())]
    report["ratio_pair_median"] = statistics.median(pair_ratios)
    # the median step shrugs off stalls that other processes cause on a shared machine
    report["ratio_step_median"] = (
        report["plain"]["step_median_s"] / report["astrai"]["step_median_s"]
    )
    # CPU time is what this process itself spent, whatever other processes on the machine
    # took (threads=1: CPU time is compute time; with more threads it counts spin-waits too)
    report["ratio_cpu_time"] = (
        report["plain"]["cpu_seconds_min"] / report["astrai"]["cpu_seconds_min"]
    )
    pairs = zip(report["astrai"]["losses"], report["plain"]["losses"])
    report["max_loss_diff"] = max(abs(a - b) for a, b in pairs)
    if peak_source.startswith("measured"):  # the machine's best: measured again after the runs
        again = peak_flops(cfg, device)
        peak = max(peak, again[0])
        peak_cpu = max(peak_cpu, again[1]) if peak_cpu and again[1] else None
    report["peak_flops"], report["peak_flops_cpu_time"] = peak, peak_cpu
    for side in runs:
        r = report[side]
        r["mfu"] = per_token * r["tokens_per_s"] / peak
        # per CPU-second, against the matmul's per CPU-second: what an idle machine would show
        r["mfu_cpu_time"] = (
            per_token * r["tokens"] / r["cpu_seconds_min"] / peak_cpu if peak_cpu else None
        )
    report["load_avg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    return report


def format_report(report: dict[str, Any]) -> str:
    """A small table: both sides' tokens/s, median step time and MFU, and their ratio."""
    lines = [
        f"model {report['model']} ({report['parameters'] / 1e6:.1f}M parameters) on "
        f"{report['device']}, {report['threads']} threads, compile={report['compile']}; "
        f"batch {report['config']['batch_size']} x {report['config']['seq_len']}, "
        f"{report['astrai']['steps']} timed steps",
        f"peak {report['peak_flops'] / 1e12:.3f} TFLOP/s ({report['peak_source']}), "
        f"{report['flops_per_token'] / 1e6:.1f} MFLOP/token",
        f"{'':8} {'tokens/s':>10} {'step ms':>9} {'MFU':>7} {'CPU s':>7} {'MFU/CPU s':>10}",
    ]
    for side in ("astrai", "plain"):
        r = report[side]
        per_cpu = f"{r['mfu_cpu_time'] * 100:9.1f}%" if r["mfu_cpu_time"] else f"{'-':>10}"
        lines.append(
            f"{side:8} {r['tokens_per_s']:10.0f} {r['step_median_s'] * 1e3:9.1f} "
            f"{r['mfu'] * 100:6.1f}% {r['cpu_seconds_min']:7.2f} {per_cpu}"
        )
    lines.append(
        f"astrai / plain: {report['ratio']:.3f}x tokens/s (target >= 0.97x), "
        f"{report['ratio_pair_median']:.3f}x median of run pairs, "
        f"{report['ratio_step_median']:.3f}x median step, "
        f"{report['ratio_cpu_time']:.3f}x CPU time; "
        f"largest loss difference {report['max_loss_diff']:.2e}"
    )
    return "\n".join(lines)
