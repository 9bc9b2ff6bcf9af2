"""`LMModule`: the LightningModule every training strategy (pretrain, sft, the preference
methods, reward, grpo) extends.

It owns the policy model (from a model factory that Hydra builds out of `conf/model/`), the
tokenizer, optional LoRA adapters, the optimizer and schedule (factories from `conf/optim/`)
and the non-finite-loss guard. A strategy implements only `compute_loss(batch) -> (loss,
metrics)`; Lightning does the loop, precision, accumulation, clipping, distribution and
checkpointing. The features several strategies share live here, once: the token log-prob
(`token_logprobs`, whose home is `astrai.likelihood`), the language-model loss (`lm_loss`), a frozen reference policy
(`ReferencePolicy`) and starting from an earlier export (`init_from`).

The model config is instantiated to a *factory* (`_partial_: true`), not to a model: the
strategy calls it once for the live weights, while the entry point calls it with
`device="meta"` to check shapes, parameter counts and the tokenizer's fit before any data is
prepared or memory allocated.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.utilities.parsing import collect_init_args
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from astrai.data.datasets import IGNORE_INDEX
from astrai.data.sampler import BatchConsumer
from astrai.likelihood import (
    DEFAULT_LOGITS_CHUNK_SIZE,
    LogitsHead,
    TokenScores,
    logits_head,
    scores_loss,
    token_logprobs,
)
from astrai.model import (
    LoRAConfig,
    Transformer,
    check_vocab,
    inject_lora,
    load_pretrained,
    merge_lora,
    save_pretrained,
)
from astrai.model.moe import inactive_expert_parameters
from astrai.tokenizer import AutoTokenizer
from astrai.train.engine_weights import GatheredWeights, ShardedCompanions
from astrai.train.optim import OptimizerFactory, ScheduleFactory, adamw, configure_optimizers
from astrai.train.policy_engine import PolicyEngine
from astrai.train.tensor_parallel import copies

log = logging.getLogger(__name__)

__all__ = [
    "LMModule",
    "NonFiniteLossError",
    "ReferencePolicy",
    "grad_stats",
    "init_from_export",
    "lm_loss",
    "scores_loss",
    "token_logprobs",
]

#: `(device=None, tokenizer=None) -> Transformer`: what a `conf/model` partial becomes
#: (`astrai.model.preset_model` / `pretrained_model`).
ModelFactory = Callable[..., Transformer]


class NonFiniteLossError(RuntimeError):
    """Raised when the loss (or gradient norm) is NaN/inf, before any weight is changed."""


def init_from_export(model: nn.Module, path: str | None, *, required: bool = False) -> bool:
    """Copy the weights of an earlier run's export (e.g. ``outputs/tiny_sft/latest/export``)
    into ``model``, whose architecture must match. A missing directory is an error when
    ``required``, else a warning and the model keeps its fresh initialisation: the tiny
    experiments then still run standalone on a fresh clone.
    """
    if not path:
        return False
    if not Path(path).is_dir():
        if required:
            raise FileNotFoundError(f"init_from: model directory {path} does not exist")
        log.warning(
            "init_from: %s does not exist; starting from a fresh initialisation instead "
            "(run the earlier stage first, e.g. +experiment=tiny_sft, for a meaningful start)",
            path,
        )
        return False
    src = load_pretrained(path, dtype=torch.float32)
    ours, theirs = model.config.to_dict(), src.config.to_dict()
    diff = {
        k: (ours.get(k), theirs.get(k))
        for k in set(ours) | set(theirs)
        if ours.get(k) != theirs.get(k)
    }
    diff.pop("torch_dtype", None)
    if diff:
        raise ValueError(f"init_from: {path} does not match the configured model: {diff}")
    # LoRA-injected models hold the base weights under `<name>.base_layer.` and add adapters.
    theirs_sd = src.state_dict()
    state = {
        key: theirs_sd[key.replace(".base_layer.", ".")]
        for key in model.state_dict()
        if ".lora_" not in key
    }
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
    log.info("init_from: loaded the weights of %s", path)
    return True


class ReferencePolicy:
    """A frozen copy of a policy (eval mode, no gradients, optional `dtype`): the reference
    of DPO and of GRPO's KL term.

    Held as a plain attribute, not a submodule, so it is never in the optimizer and Lightning
    does not move it; `on(device)` follows the policy on first use. Made in the strategy's
    `__init__`, before Lightning restores a checkpoint, so a resumed run keeps the *initial*
    policy as its reference. A reference that moves (GRPO's `sync_interval`) is saved in the
    checkpoint by its strategy (`astrai.train.strategies.grpo.reference`). Under
    `trainer=fsdp2` the strategy shards it as it shards the policy (`shard`): its forward
    gathers each unit's shards in turn, so no rank holds the whole reference.
    """

    def __init__(self, policy: nn.Module, dtype: str | torch.dtype | None = None) -> None:
        model = copy.deepcopy(policy)
        model.eval()
        model.requires_grad_(False)
        if dtype is not None:
            model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        self.model = model

    def on(self, device: torch.device) -> nn.Module:
        """The frozen model, moved to `device` if it is elsewhere."""
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        return self.model

    def shard(self, shard: Callable[[nn.Module], None]) -> None:
        """Shard the frozen model with the policy's mesh (`shard`: the strategy's)."""
        shard(self.model)


# ---------------------------------------------------------------------- losses


def lm_loss(
    logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Mean cross entropy over tokens whose label is not `IGNORE_INDEX`, and their count.

    Labels are already shifted by the datasets (`labels[t]` follows `input_ids[t]`).
    """
    n = (labels != IGNORE_INDEX).sum()
    loss = F.cross_entropy(
        logits.float().flatten(0, 1),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        label_smoothing=label_smoothing,
    )
    return loss, n


def _abs_max(t: Tensor) -> Tensor:
    """The largest absolute element of `t` in fp32 (0 when empty), without an `abs()` copy."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return torch.stack(torch.aminmax(t)).abs().max().float()


def grad_stats(grads: list[Tensor]) -> dict[str, float]:
    """`grad_norm` (total L2 norm), `grad_max` (largest absolute element) and `grad_nonfinite`
    (number of NaN/inf elements) of a list of gradients.

    Two foreach norms (accumulated in fp32 whatever the gradients' dtype) per device and one
    device sync per call; the elements are counted only when the norm is not finite (any
    NaN/inf element makes it so), so a healthy step pays nothing more. Sharded gradients
    (FSDP2's DTensors) are reduced over their ranks: every rank gets the whole gradient's
    values, and a non-finite norm stops all of them at once.
    """
    sharded = any(isinstance(g, DTensor) for g in grads)
    # how many processes hold each local shard (tensor parallelism replicates some)
    shares = [copies(g) for g in grads]
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        by_device.setdefault(g.device, []).append(i)
    first = grads[0].device
    order: list[int] = []
    l2: list[Tensor] = []
    linf: list[Tensor] = []
    for device, index in by_device.items():
        group = [grads[i] for i in index]
        order += index
        l2 += [n.to(first) for n in torch._foreach_norm(group, 2.0, dtype=torch.float32)]
        if device.type == "cpu":  # the foreach inf-norm is ~30x slower than min/max on CPU
            linf += [_abs_max(g).to(first) for g in group]
        else:
            linf += [n.to(first) for n in torch._foreach_norm(group, math.inf, dtype=torch.float32)]
    stats = torch.stack([torch.linalg.vector_norm(torch.stack(l2)), torch.stack(linf).max()])
    if sharded:  # sum of squares and max over the shards, each shard counted once
        square = stats[0].square()
        if any(shares[i] > 1 for i in order):
            weight = torch.tensor([1.0 / shares[i] for i in order], device=first)
            square = (torch.stack(l2).square() * weight).sum()
        square, largest = square.reshape(1), stats[1].reshape(1)
        torch.distributed.all_reduce(square)
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
        stats = torch.cat([square.sqrt(), largest])
    norm, largest = stats.tolist()
    nonfinite = 0
    if not math.isfinite(norm):
        nonfinite = int(sum((~torch.isfinite(g)).sum() for g in grads))
    return {"grad_norm": norm, "grad_max": largest, "grad_nonfinite": float(nonfinite)}


def check_label_smoothing(value: float) -> float:
    """`strategy.label_smoothing` must lie in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"strategy.label_smoothing: must be in [0, 1), got {value}")
    return float(value)


# ---------------------------------------------------------------------- hyperparameters
def _hparam(value: Any) -> Any:
    """A loggable stand-in for a constructor argument: a factory (partial) becomes its
    config (`{"_target_": ..., **keywords}`), a module its class name."""
    if isinstance(value, functools.partial):
        target = f"{value.func.__module__}.{value.func.__qualname__}"
        return {"_target_": target, **{k: _hparam(v) for k, v in value.keywords.items()}}
    if isinstance(value, nn.Module):
        return type(value).__name__
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {k: _hparam(v) for k, v in value.items()}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}.{value.__qualname__}"
    return value


def _to_safe(states: dict[str, Any]) -> dict[str, Any]:
    """RNG states as plain lists: loadable with `weights_only=True` (Lightning's default) and
    safe for `all_gather_object` (which cannot carry tensors between gloo ranks here)."""
    out = dict(states)
    out["torch"] = states["torch"].tolist()
    if "torch.cuda" in out:
        out["torch.cuda"] = [t.tolist() for t in states["torch.cuda"]]
    if "numpy" in out:
        kind, keys, *rest = states["numpy"]
        out["numpy"] = (kind, keys.tolist(), *rest)
    return out


def _from_safe(states: dict[str, Any]) -> dict[str, Any]:
    out = dict(states)
    out["torch"] = torch.tensor(states["torch"], dtype=torch.uint8)
    if "torch.cuda" in out:
        cuda = [torch.tensor(t, dtype=torch.uint8) for t in states["torch.cuda"]]
        if len(cuda) == torch.cuda.device_count():
            out["torch.cuda"] = cuda
        else:  # resumed on another number of GPUs: leave their generators seeded
            del out["torch.cuda"]
    if "numpy" in out:
        kind, keys, *rest = states["numpy"]
        out["numpy"] = (kind, np.asarray(keys, dtype=np.uint32), *rest)
    return out


class LMModule(L.LightningModule, BatchConsumer, ShardedCompanions, ABC):
    """Base LightningModule for language-model training strategies (the shape of
    lightning-hydra-template's `MNISTLitModule(net, optimizer, scheduler)`).

    Args:
        model: a model factory (`conf/model/*.yaml` instantiates `preset_model` or
            `pretrained_model` as a partial), called with `tokenizer=` to check the fit; or
            a ready `Transformer`.
        optimizer: `(model) -> Optimizer`, e.g. `partial(astrai.train.optim.adamw, lr=3e-3)`
            (`conf/optim/*.yaml`); default AdamW with its defaults.
        scheduler: `(total_steps=...) -> multiplier(step)`, e.g.
            `partial(astrai.train.optim.cosine, warmup_steps=20)` (`conf/optim/schedule/`);
            default constant.
        tokenizer: tokenizer directory; its size is checked against the model's vocabulary,
            and it is saved with every export.
        lora: `LoRAConfig` fields; when given, only adapters train (exports merge them).
        gradient_checkpointing: recompute block activations in backward (memory for time).
        check_grad_finite: also stop on a non-finite gradient norm, before the optimizer
            step, so no checkpoint is ever written with NaN weights.
        init_from: an earlier run's export to start from (same architecture as `model`);
            when the directory does not exist the run starts fresh with a warning.
        label_smoothing: token cross entropy's smoothing (`token_loss`, pretraining and
            SFT), in [0, 1); DPO reads its own `label_smoothing` (cDPO's label-noise rate).
        logits_chunk_size: target tokens per chunk of the LM head (`astrai.model.head`: the
            log-probs, losses and entropy of every strategy never hold the `[B, S, V]`
            logits); None: the dense path (full logits). Read as `self.head`.
        use_liger_kernel: TRL's name for Liger's fused linear losses; refused, naming the key,
            before the model is built (`astrai.likelihood.check_liger_kernel` says why).

    Declared for the other rooms (read, never discovered): `batch_reuse` and
    `batch_lookahead` (`astrai.data.sampler.BatchConsumer`: how the data module hands out
    loader batches; the defaults reuse nothing, GRPO overrides them) and `policy_engine`
    (`astrai.train.policy_engine.PolicyEngine`: the run's one live inference engine, which
    the evaluation callback and `serve_policy` use, and GRPO's rollouts; closed in
    `teardown`).

    Hyperparameters (`self.hparams`, logged and kept in checkpoints) are the constructor
    arguments of the whole class chain, with factories stored as their config and modules
    as their class name, so no model or partial is pickled into a checkpoint.
    """

    def __init__(
        self,
        model: ModelFactory | Transformer,
        optimizer: OptimizerFactory | None = None,
        scheduler: ScheduleFactory | None = None,
        tokenizer: str | None = None,
        lora: Mapping[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        check_grad_finite: bool = True,
        init_from: str | None = None,
        label_smoothing: float = 0.0,
        logits_chunk_size: int | None = DEFAULT_LOGITS_CHUNK_SIZE,
        use_liger_kernel: bool = False,
    ) -> None:
        smoothing = check_label_smoothing(label_smoothing)  # before the model is built
        head = logits_head(logits_chunk_size, use_liger_kernel)
        super().__init__()
        self.label_smoothing = smoothing
        # how every strategy scores tokens through the LM head: chunked, or the full logits
        self.head: LogitsHead = head
        init_args: dict[str, Any] = {}
        for level in collect_init_args(inspect.currentframe(), [], classes=(LMModule,)):
            init_args.update(level)
        self.save_hyperparameters({k: _hparam(v) for k, v in init_args.items()})
        self.make_optimizer: OptimizerFactory = optimizer or adamw
        self.make_schedule: ScheduleFactory | None = scheduler
        self.check_grad_finite = check_grad_finite
        self.tokenizer: AutoTokenizer | None = (
            AutoTokenizer.from_pretrained(str(tokenizer)) if tokenizer else None
        )
        if isinstance(model, nn.Module):
            if self.tokenizer is not None:
                check_vocab(model.config.vocab_size, self.tokenizer)
            self.model: Transformer = model
        else:
            self.model = model(tokenizer=self.tokenizer)
        self.model.gradient_checkpointing = bool(gradient_checkpointing)
        self.lora_config: LoRAConfig | None = None
        if lora:
            self.lora_config = LoRAConfig(**lora)
            inject_lora(self.model, self.lora_config)
        init_from_export(self.model, init_from)
        # DPO and GRPO set a frozen copy of the initial policy here (after init_from)
        self.reference: ReferencePolicy | None = None
        # a mixture of experts runs only its routed experts per token: active parameters
        active = self.model.num_parameters() - inactive_expert_parameters(self.model)
        self.flops_per_token: float = 6.0 * active
        self.flops_per_batch: float | None = None  # read by Lightning's ThroughputMonitor
        # exact resume: the checkpoint's RNG states, restored at the first step after loading,
        # and the states validation started with (restored when it ends)
        self._resume_rng: list[dict[str, Any]] | None = None
        self._rng_outside_validation: dict[str, Any] | None = None
        self.model_compiled = False  # set by configure_model (model.compile=true)
        # the run's one inference engine on the live weights (evaluation, the live policy
        # server, GRPO's rollouts); built on first use, shut down in teardown
        self.policy_engine = PolicyEngine(self.live_policy)

    def live_policy(self) -> tuple[Transformer, AutoTokenizer | None]:
        """The live policy and its tokenizer (what the policy engine is built on)."""
        return self.model, self.tokenizer

    def shard_companions(self, shard: Callable[[nn.Module], None]) -> None:
        """`trainer=fsdp2` sharded the policy: shard the frozen reference the same way, and
        run the policy engine on full weights gathered from the shards
        (`astrai.train.engine_weights`)."""
        if self.reference is not None:
            self.reference.shard(shard)
        self.policy_engine.use_weights(GatheredWeights(self.lora_config))

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        self.policy_engine.close()

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def compute_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """Return the scalar loss to minimise and extra metrics (logged as `train/<name>`)."""

    # ------------------------------------------------------------------ helpers
    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        return self.model(input_ids, **kwargs)

    def token_loss(
        self, input_ids: Tensor, labels: Tensor, **forward: Tensor | None
    ) -> tuple[Tensor, Tensor, TokenScores]:
        """Mean cross entropy of the policy over labelled tokens (with `label_smoothing`),
        their count, and the per-token scores (through `self.head`: chunked or dense);
        `forward`: the model's `position_ids` / `attention_mask`."""
        smoothing = self.label_smoothing > 0
        scores = self.head.scores(
            self.model, input_ids, labels, label_smoothing=smoothing, **forward
        )
        loss, n = scores_loss(scores, labels, label_smoothing=self.label_smoothing)
        return loss, n, scores

    def export_model(self) -> Transformer:
        """The model as it should be saved: LoRA adapters merged into a copy when present."""
        if self.lora_config is None:
            return self.model
        return merge_lora(copy.deepcopy(self.model))

    def save_pretrained(self, path: str | Path, **kwargs: Any) -> Path:
        """`astrai.model.save_pretrained` the (merged) model with the tokenizer into `path`."""
        path = Path(path)
        save_pretrained(self.export_model(), path, tokenizer=self.tokenizer, **kwargs)
        return path

    @staticmethod
    def _batch_size(batch: dict[str, Any]) -> int:
        for key in ("input_ids", "chosen_input_ids"):
            if key in batch and isinstance(batch[key], Tensor):
                return int(batch[key].shape[0])
        return 1

    def _check_finite(self, loss: Tensor, what: str) -> None:
        if not bool(torch.isfinite(loss.detach()).all()):
            ckpt = "none yet"
            trainer = self._trainer
            if trainer is not None and trainer.checkpoint_callback is not None:
                ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or "none yet"
            step = trainer.global_step if trainer is not None else -1
            raise NonFiniteLossError(
                f"{what} is {loss.detach().float().item()} at global step {step}; training "
                f"stopped before the optimizer step, so the last checkpoint ({ckpt}) is "
                f"intact. Lower optim.lr, enable trainer.gradient_clip_val, or check the data."
            )

    # ------------------------------------------------------------------ Lightning hooks
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if "input_ids" in batch and isinstance(batch["input_ids"], Tensor):
            ids = batch["input_ids"]
            self.flops_per_batch = self.flops_per_token * ids.numel()
        loss, metrics = self.compute_loss(batch)
        bs = self._batch_size(batch)
        loss = loss + self.router_loss(bs)
        self._check_finite(loss, "the training loss")
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=bs)
        for key, value in metrics.items():
            self.log(f"train/{key}", value, batch_size=bs)
        return loss

    def router_loss(self, batch_size: int = 1) -> Tensor | float:
        """`router_aux_loss_coef * load-balancing + router_z_loss_coef * z-loss` of the policy's
        latest training forward (0 for a dense model), added to every strategy's loss here.

        Logs `train/router/aux_loss`, `train/router/z_loss` (means over MoE layers) and each
        layer's expert-load coefficient of variation `train/router/load_cv/layer_<i>` with
        their mean `train/router/load_cv`.
        """
        stats = self.model.router_stats()
        if not stats:
            return 0.0
        aux, z = self.model.moe_aux_loss()
        config = self.model.config
        self.log("train/router/aux_loss", aux.detach(), batch_size=batch_size)
        self.log("train/router/z_loss", z.detach(), batch_size=batch_size)
        cvs = [s.load_cv() for s in stats]
        for s, cv in zip(stats, cvs):
            self.log(f"train/router/load_cv/layer_{s.layer_id}", cv, batch_size=batch_size)
        self.log("train/router/load_cv", torch.stack(cvs).mean(), batch_size=batch_size)
        return config.router_aux_loss_coef * aux + config.router_z_loss_coef * z

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, metrics = self.compute_loss(batch)
        bs = self._batch_size(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=bs)
        for key, value in metrics.items():
            self.log(f"val/{key}", value, sync_dist=True, batch_size=bs)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log gradient statistics of every optimizer step, before clipping (and, with fp16,
        after unscaling): `train/grad_norm` (total L2), `train/grad_max` (largest absolute
        element) and `train/grad_nonfinite` (count of NaN/inf elements). Then, with
        `check_grad_finite`, stop on a non-finite norm (not under fp16 precision, whose
        GradScaler skips such steps by design). The policy engine sleeps through the step
        (``engine.enable_sleep_mode``: `sleep_engine_for_step`)."""
        self.sleep_engine_for_step()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        stats = grad_stats(grads)
        for name, value in stats.items():
            self.log(f"train/{name}", value, batch_size=1)
        precision = str(getattr(self._trainer, "precision", ""))
        if self.check_grad_finite and not precision.startswith("16"):
            self._check_finite(torch.tensor(stats["grad_norm"]), "the gradient norm")

    def sleep_engine_for_step(self) -> None:
        """The policy engine's memory (KV pool, packs) is the optimizer's until its next use
        (`PolicyEngine.sleep`: only an engine built with ``enable_sleep_mode``)."""
        self.policy_engine.sleep()

    # ------------------------------------------------------------------ exact resume
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add every rank's RNG states (Lightning's checkpoint has none), for exact resume of
        anything random (dropout, LoRA dropout, sampling) across an interruption."""
        states = _to_safe(_collect_rng_states(include_cuda=torch.cuda.is_available()))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, states)
            checkpoint["astrai_rng_states"] = gathered
        else:
            checkpoint["astrai_rng_states"] = [states]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._resume_rng = checkpoint.get("astrai_rng_states")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # restored here, at the first step after resuming, rather than at load time: Lightning
        # builds dataloaders and may run other hooks between loading and this step
        states = self._resume_rng
        if states:
            rank = self.global_rank if self._trainer is not None else 0
            if rank < len(states):
                _set_rng_states(_from_safe(states[rank]))
            self._resume_rng = None

    def on_validation_start(self) -> None:
        # Validation leaves the random streams as it found them. A checkpoint is written at the
        # end of a training step, before that step's validation; so the next step must see
        # the same state whether or not a validation ran in between (an interrupted run
        # resumes after it without running it again).
        self._rng_outside_validation = _collect_rng_states(include_cuda=torch.cuda.is_available())

    def on_validation_end(self) -> None:
        if self._rng_outside_validation is not None:
            _set_rng_states(self._rng_outside_validation)
            self._rng_outside_validation = None

    def configure_model(self) -> None:
        """`model.compile=true`: compile the policy's training forward with torch.compile
        (`Transformer.compile_for_training`: parameter names, checkpoints and exports are
        unchanged). Here, once the module is built, so a frozen reference copied in
        `__init__` stays eager."""
        if self.model.compile_training and not self.model_compiled:
            self.model.compile_for_training()
            self.model_compiled = True
            log.info("model.compile: the training forward is compiled by torch.compile")

    def configure_optimizers(self) -> Any:
        total = None
        if self._trainer is not None:
            est = self.trainer.estimated_stepping_batches
            total = int(est) if est is not None and math.isfinite(est) else None
        return configure_optimizers(
            self.model, self.make_optimizer, self.make_schedule, total_steps=total
        )
