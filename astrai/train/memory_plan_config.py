"""The memory plan of a composed training config (`astrai.train.memory_plan`'s inputs read
from its keys), logged before anything loads, and `plan_only=true`.

Keys read (each with the default the run itself would use): the model's shape
(`astrai.train.model_shape`); `trainer.precision`, `trainer.devices` x `trainer.num_nodes`,
`trainer.strategy` (FSDP2's `param_dtype`, `reshard_after_forward`, `activation_checkpointing`,
`tensor_parallel_size`); `optim._target_` and `optim.fused`; `strategy.gradient_checkpointing`,
`strategy.reference_dtype` / `kl_coef` / `reference`, `strategy.logits_chunk_size` (absent:
the chunked path's default, null: dense), GRPO's `num_generations`, `max_new_tokens`,
`padding_free` / `use_dynamic_bsz` / `ppo_max_token_len_per_gpu` (absent: off) and its
`engine` (`kv_tokens` or `memory_fraction`, `max_batch_size`, `max_seq_len`,
`enable_sleep_mode`); PPO's `strategy.critic.init` (`policy`: the policy's shape; a path: its
`config.json`); distillation's `strategy.teacher_model_name_or_path` (its `config.json`; null:
the data's stored top-k, no teacher model) and `teacher_model_init_kwargs.dtype` (absent: the
export's `torch_dtype`, else the policy's parameter dtype, the dtype a run's export stores,
as the teacher loads with its stored dtype); `data.batch_size` and the sequence length of
`data.train`; and `device_memory_gib` (else CUDA's own, when there is a GPU).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from astrai.model.config import ModelConfig
from astrai.train.memory_plan import (
    DEFAULT_LOGITS_CHUNK,
    GIB,
    EngineShape,
    Layout,
    MemoryPlan,
    Workload,
    describe,
    kv_bytes_per_token,
    plan_memory,
)
from astrai.train.model_shape import export_shape, model_shape

log = logging.getLogger(__name__)

__all__ = ["config_plan", "device_capacity", "log_plan", "plan_only", "world_size"]

#: Lightning's `precision` -> (parameter bytes, compute bytes, autocast)
PRECISIONS = {
    "32-true": (4, 4, False),
    "32": (4, 4, False),
    "64-true": (8, 8, False),
    "64": (8, 8, False),
    "16-mixed": (4, 2, True),
    "bf16-mixed": (4, 2, True),
    "16-true": (2, 2, False),
    "bf16-true": (2, 2, False),
}
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}
#: strategies that train a critic beside the policy / score with a frozen teacher model
CRITIC_STRATEGY = "PPOModule"
TEACHER_STRATEGY = "DistillModule"
#: strategies whose training rows come in pairs (chosen and rejected; KTO's KL batch)
PAIRED = ("DPOModule", "CPOModule", "ORPOModule", "KTOModule", "RewardModule")
GPU_ACCELERATORS = ("gpu", "cuda")


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default, throw_on_missing=False)


def world_size(trainer: Any) -> int:
    """Ranks of a `trainer` node: devices x nodes ("auto", -1: 1, decided by Lightning)."""
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    devices = len(devices) if isinstance(devices, (list, tuple)) else devices
    if not isinstance(devices, int) or devices < 1:
        devices = 1
    return devices * (nodes if isinstance(nodes, int) and nodes > 0 else 1)


def device_capacity(cfg: DictConfig) -> int | None:
    """One device's memory in bytes: `device_memory_gib`, else the first CUDA device's (a GPU
    trainer on a machine with the driver), else unknown."""
    configured = _select(cfg, "device_memory_gib")
    if configured is not None:
        return int(float(configured) * GIB)
    accelerator = str(_select(cfg, "trainer.accelerator", "auto")).lower()
    if accelerator not in (*GPU_ACCELERATORS, "auto"):
        return None
    if not Path("/proc/driver/nvidia").exists() and not Path("/dev/nvidiactl").exists():
        return None  # (no driver: found without importing torch)
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


# ---------------------------------------------------------------------- layout
def layout_of(cfg: DictConfig) -> Layout:
    """Where the weights live and in which dtypes: `trainer.precision` and `trainer.strategy`."""
    trainer = cfg.get("trainer") or {}
    precision = str(trainer.get("precision", "32-true"))
    if precision not in PRECISIONS:
        raise ValueError(
            f"trainer.precision={precision!r}: the memory plan knows {list(PRECISIONS)}"
        )
    master, compute, mixed = PRECISIONS[precision]
    strategy = trainer.get("strategy")
    target = str(strategy.get("_target_", "")) if OmegaConf.is_dict(strategy) else ""
    node = strategy if OmegaConf.is_dict(strategy) else {}
    sharded, reshard, shard_bytes = False, True, None
    if target.endswith("FullyShardStrategy"):
        sharded = True
        reshard = bool(node.get("reshard_after_forward", True))
        dtype = node.get("param_dtype")
        shard_bytes = DTYPE_BYTES[str(dtype)] if dtype is not None else None
    elif target.endswith("FSDPStrategy"):  # Lightning's first FSDP API (trainer=fsdp)
        kind = str(node.get("sharding_strategy", "FULL_SHARD"))
        sharded, reshard = kind != "NO_SHARD", kind == "FULL_SHARD"
        shard_bytes = compute if mixed else None
    tp = node.get("tensor_parallel_size", trainer.get("tensor_parallel_size", 1))
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    return Layout(
        world_size=world_size(trainer),
        tensor_parallel=int(tp) if isinstance(tp, int) and tp > 0 else 1,
        fully_sharded=sharded,
        reshard_after_forward=reshard,
        master_bytes=master,
        compute_bytes=compute,
        shard_bytes=shard_bytes,
        mixed=mixed,
        gpu=accelerator in GPU_ACCELERATORS or target.endswith("FSDPStrategy"),
    )


# ---------------------------------------------------------------------- workload
def _sequence_length(cfg: DictConfig, model: ModelConfig) -> int:
    """One training row's padded length: the data's window or maximum length."""
    for key in ("data.train.window_size", "data.train.prepare.window_size"):
        value = _select(cfg, key)
        if isinstance(value, int):
            return value
    value = _select(cfg, "data.train.prepare.max_length")
    return value if isinstance(value, int) else model.max_position_embeddings


def engine_shape(cfg: DictConfig, model: ModelConfig, capacity: int | None) -> EngineShape | None:
    """The rollout engine's sizes (`strategy.engine`; None: the strategy has none)."""
    node = _select(cfg, "strategy.engine")
    if node is None or _select(cfg, "strategy.num_generations") is None:
        return None
    batch = int(node.get("max_batch_size", 32))
    seq = node.get("max_seq_len") or min(model.max_position_embeddings, 4096)
    tokens = batch * seq
    if node.get("cache_mode", "contiguous") == "paged":
        page = int(node.get("page_size", 16))
        fraction = node.get("memory_fraction")
        if node.get("kv_tokens") is not None:
            tokens = int(node.kv_tokens)
        elif fraction is not None and capacity is not None:  # (the engine: of free memory)
            per_token = kv_bytes_per_token(model, layout_of(cfg).engine_bytes)
            tokens = int(capacity * float(fraction)) // per_token
        tokens = tokens // page * page
    return EngineShape(
        kv_tokens=tokens,
        max_batch_size=batch,
        max_prefill_tokens=int(node.get("max_prefill_tokens", 2048)),
        logprob_chunk=int(node.get("logprob_chunk", 512)),
        packed_projections=bool(node.get("packed_projections", True)),
        sleep=bool(node.get("enable_sleep_mode", False)),
    )


def micro_batch_tokens(cfg: DictConfig, model: ModelConfig) -> int:
    """Tokens of one training micro-batch, rows padded to the longest possible: GRPO's
    prompts x `num_generations` rollouts of prompt + `max_new_tokens` (at most the engine's
    `max_seq_len`), pairs for the preference strategies, windows or records otherwise."""
    batch = int(_select(cfg, "data.batch_size", 1))
    generations = _select(cfg, "strategy.num_generations")
    if generations is not None:
        seq = int(_select(cfg, "strategy.engine.max_seq_len") or model.max_position_embeddings)
        prompt = _select(cfg, "data.train.prepare.max_length")
        new = int(_select(cfg, "strategy.max_new_tokens", 0))
        if isinstance(prompt, int):
            seq = min(seq, prompt + new)
        return batch * int(generations) * seq
    target = str(_select(cfg, "strategy._target_", ""))
    rows = batch * (2 if target.endswith(PAIRED) else 1)
    return rows * _sequence_length(cfg, model)


def forward_tokens(cfg: DictConfig) -> int | None:
    """Tokens of one forward when GRPO packs its micro-batch into rows by token budget
    (`padding_free` with `use_dynamic_bsz`: rows of `ppo_max_token_len_per_gpu`, each
    recomputed in its backward); None: the micro-batch in one forward."""
    strategy = cfg.get("strategy") or {}
    if not (strategy.get("padding_free", False) and strategy.get("use_dynamic_bsz", False)):
        return None
    return int(strategy.get("ppo_max_token_len_per_gpu", 16384))


def _optimizer(cfg: DictConfig) -> dict[str, Any]:
    target = str(_select(cfg, "optim._target_", "")).rsplit(".", 1)[-1]
    fused = bool(_select(cfg, "optim.fused", False))
    if target == "sgd":
        momentum = float(_select(cfg, "optim.momentum", 0.9))
        return {"optimizer": "SGD", "optimizer_states": 1.0 if momentum else 0.0}
    if target == "muon":
        return {
            "optimizer": "Muon + AdamW",
            "optimizer_states": 2.0,
            "hidden_optimizer_states": 1.0,
            "fused_optimizer": fused,
        }
    name = "AdamW" if target == "adamw" else f"{target or 'optimizer'} (as AdamW)"
    return {"optimizer": name, "optimizer_states": 2.0, "fused_optimizer": fused}


def _reference_bytes(cfg: DictConfig, layout: Layout) -> int | None:
    """Bytes per value of the frozen reference copy; None when the strategy keeps none."""
    strategy = cfg.get("strategy") or {}
    if "reference_dtype" not in strategy:
        return None
    if strategy.get("kl_coef", 1.0) == 0 or strategy.get("reference", "copy") != "copy":
        return None
    dtype = strategy.get("reference_dtype")
    return DTYPE_BYTES[str(dtype)] if dtype is not None else layout.master_bytes


def critic_shape(cfg: DictConfig, model: ModelConfig) -> ModelConfig | None:
    """The backbone PPO's critic trains (None: the strategy has no critic): the policy's
    (`strategy.critic.init: policy`) or the `config.json` of the export it loads (a path
    not there yet is planned as the policy's shape; preflight names it)."""
    if not str(_select(cfg, "strategy._target_", "")).endswith(CRITIC_STRATEGY):
        return None
    init = str(_select(cfg, "strategy.critic.init", "policy"))
    if init == "policy" or not (Path(init) / "config.json").is_file():
        return model
    return export_shape(init).config


def teacher_of(cfg: DictConfig, layout: Layout) -> tuple[ModelConfig, int] | None:
    """Distillation's frozen teacher: its configuration (`config.json` of
    `strategy.teacher_model_name_or_path`) and bytes per value (see the module docstring);
    None: no teacher model (another strategy, or the data's stored top-k)."""
    if not str(_select(cfg, "strategy._target_", "")).endswith(TEACHER_STRATEGY):
        return None
    path = _select(cfg, "strategy.teacher_model_name_or_path")
    if not path:
        return None
    config = export_shape(str(path)).config
    kwargs = _select(cfg, "strategy.teacher_model_init_kwargs") or {}
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype")) or _stored_dtype(Path(str(path)))
    return config, DTYPE_BYTES[str(dtype)] if dtype is not None else layout.master_bytes


def _stored_dtype(path: Path) -> str | None:
    """The `torch_dtype` an export's `config.json` names (Hugging Face's; astrai's has none)."""
    data = json.loads((path / "config.json").read_text())
    dtype = data.get("torch_dtype", data.get("dtype")) if isinstance(data, dict) else None
    return dtype if isinstance(dtype, str) and dtype in DTYPE_BYTES else None


def workload_of(cfg: DictConfig, model: ModelConfig, capacity: int | None) -> Workload:
    """What one step runs, from `strategy`, `data` and `optim`."""
    layout = layout_of(cfg)
    strategy = cfg.get("strategy") or {}
    chunk = strategy.get("logits_chunk_size", DEFAULT_LOGITS_CHUNK)
    checkpointing = bool(strategy.get("gradient_checkpointing", False)) or bool(
        _select(cfg, "trainer.strategy.activation_checkpointing", False)
        or _select(cfg, "trainer.strategy.activation_checkpointing_policy")
    )
    teacher = teacher_of(cfg, layout)
    return Workload(
        micro_batch_tokens=micro_batch_tokens(cfg, model),
        forward_tokens=forward_tokens(cfg),
        logits_chunk_size=int(chunk) if chunk is not None else None,
        gradient_checkpointing=checkpointing,
        reference_bytes=_reference_bytes(cfg, layout),
        engine=engine_shape(cfg, model, capacity),
        critic=critic_shape(cfg, model),
        teacher=teacher[0] if teacher else None,
        teacher_bytes=teacher[1] if teacher else layout.master_bytes,
        **_optimizer(cfg),
    )


# ---------------------------------------------------------------------- entry points
def config_plan(cfg: DictConfig, capacity: int | None = None) -> MemoryPlan | None:
    """The plan of a composed training config; None when the model's shape is not known
    without loading (a model directory not given yet)."""
    shape = model_shape(cfg.get("model"))
    if shape is None:
        return None
    name = f"{shape.source}, {shape.config.num_parameters() / 1e9:.2f}B parameters"
    if _select(cfg, "strategy.lora"):
        name += " (LoRA: planned as full fine-tuning, an upper bound)"
    return plan_memory(
        shape.config,
        layout_of(cfg),
        workload_of(cfg, shape.config, capacity),
        name=name,
    )


def log_plan(cfg: DictConfig) -> MemoryPlan | None:
    """Log the plan (a warning with the numbers when it does not fit the device); never
    stops the run: a plan that cannot be made is said in one line."""
    try:
        capacity = device_capacity(cfg)
        plan = config_plan(cfg, capacity)
    except (KeyError, ValueError, TypeError, FileNotFoundError) as err:
        log.warning("memory plan: not computed (%s)", err)
        return None
    if plan is None:
        log.info("memory plan: the model's shape is not known before loading (model.path)")
        return None
    level, text = describe(plan, capacity)
    log.log(level, "%s", text)
    return plan


def plan_only(cfg: DictConfig) -> int | str:
    """`plan_only=true`: the exit status after logging the plan (0), or the message when the
    model's shape is unknown. No other check runs: a plan is made for a machine you may not
    have."""
    if model_shape(cfg.get("model")) is None:
        return (
            "plan_only: the model's shape is unknown: pass model.path=<a model directory with "
            "config.json> or a preset of the same shape (model=qwen3-8b, model=astrai-1b)"
        )
    return 0 if log_plan(cfg) is not None else "plan_only: no plan (see the warning above)"
