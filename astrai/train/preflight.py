"""Checks before a training run: every problem a composed config shows, found in seconds
without preparing data, training a tokenizer or building a model, and reported together.

`python -m astrai.train` runs them from a Hydra callback (`PreflightCallback`, registered in
conf/hydra/default.yaml) at `on_run_start`, before Hydra creates the run folder: a failed
check prints one message (no traceback), exits non-zero and leaves nothing on disk. A sweep
(`-m`) composes and checks every job's config before the first job starts
(`astrai.train.sweep.job_configs`; a sampling sweeper such as Optuna has no job list in
advance: its base config is checked, and each job as it starts); the GPU check is skipped
when a cluster launcher such as SLURM runs the jobs elsewhere. Tests and notebooks call `problems`.

`plan_only=true` runs none of them: the callback logs the memory plan and stops
(`astrai.train.memory_plan_config.plan_only`), as a plan is made for a machine you may not have.

Checks (one line per problem, naming the key and the fix):
- inputs: data sources, model.path, tokenizer.path (`runner.input_problems`);
- hardware: a GPU trainer (accelerator gpu/cuda, FSDP) on a machine without CUDA, or more
  devices than it has (`hardware=cpu_smoke` runs the *_1b recipes on a CPU at test size);
- start: `strategy.init_from`, the export DPO and GRPO start from, must exist, and so must the
  second model's: distillation's `strategy.teacher_model_name_or_path`, PPO's
  `strategy.critic.init` (when a path, not `policy`);
- resume: `ckpt_path=last` needs a checkpoint (`ckpt_path=auto`: resume if there is one); a
  run folder that already holds checkpoints needs `ckpt_path` (never a silent resume or
  restart);
- logging: W&B online needs an API key (`wandb login`; offline otherwise);
- serving: a `serve_policy` block's settings and a port already in use;
- vocabulary: the tokenizer's size must fit the model's vocab_size;
- data: enough training samples for one batch per device, where the config or the files tell
  it cheaply (built-in arithmetic `n`, JSONL line counts, corpus byte sizes as a token bound,
  packed SFT windows), and every line of a JSONL file is JSON (`astrai.train.data_checks`).
  What only preparation can tell is checked by `runner.train` after `fit`
  (`NoTrainingBatchesError`);
- settings, once every check above passed (they import Lightning and torch, which the run
  imports next anyway; a config error elsewhere is reported without them): each `trainer`
  value against the type `lightning.Trainer` declares (`trainer.max_steps=abc`), and the
  optimizer and schedule built on a two-parameter module (`optim.lr: Invalid learning rate`),
  and the LM head's `strategy.logits_chunk_size` / `strategy.use_liger_kernel`.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from astrai.train import runner, wandb_run
from astrai.train.data_checks import data_problems
from astrai.train.memory_plan_config import plan_only, world_size
from astrai.train.model_shape import model_shape
from astrai.train.sweep import job_configs, swept_overrides

__all__ = ["PreflightCallback", "format_problems", "problems"]

GPU_ACCELERATORS = ("gpu", "cuda")
#: the earlier stage whose export a strategy typically starts from (for the model.path hint)
START_STAGES = {
    "SFTModule": "pretrain_1b",
    "DPOModule": "sft_1b",
    "CPOModule": "sft_1b",
    "ORPOModule": "pretrain_1b",
    "KTOModule": "sft_1b",
    "RewardModule": "sft_1b",
    "GRPOModule": "sft_1b",
    "PPOModule": "sft_1b",
    "DistillModule": "sft_1b",
}
#: paths of a second model a strategy loads -> (what it is, the setting that needs none)
COMPANION_PATHS = {
    "strategy.teacher_model_name_or_path": (
        "the teacher's export",
        "strategy.teacher_model_name_or_path=null to distil from the data's stored top-k",
    ),
    "strategy.critic.init": (
        "the export the critic starts from",
        "strategy.critic.init=policy to start it from the policy",
    ),
}
LOCAL_LAUNCHERS = ("BasicLauncher", "JoblibLauncher")  # sweeps that run on this machine
CPU_SMOKE_HINT = (
    "on a machine without GPUs, add hardware=cpu_smoke to run this recipe at test size "
    "(python -m astrai.train +experiment={experiment} hardware=cpu_smoke), or trainer=cpu for "
    "the tiny_* experiments"
)


class PreflightCallback(Callback):
    """Hydra callback: run every check before the run folder exists; exit with all problems."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        if OmegaConf.select(config, "plan_only", default=False):  # the memory plan, and stop
            raise SystemExit(plan_only(config))
        _exit_on_problems(config, Path(str(OmegaConf.select(config, "hydra.run.dir"))))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # a cluster launcher (SLURM) submits from a login node: its GPUs are not the jobs'
        launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
        local = any(name in launcher for name in LOCAL_LAUNCHERS)
        jobs = job_configs(config)
        if jobs is None:  # a sampling sweeper (Optuna): each job is checked as it starts
            _exit_on_problems(config, None, hardware=local)
            return
        found = {}
        for i, (_, job) in enumerate(jobs):
            if isinstance(job, Exception):
                found[i] = [f"the config does not compose: {job}"]
            else:
                found[i] = problems(job, hardware=local)
        if any(found.values()):
            raise SystemExit(format_sweep_problems(jobs, found))


def _exit_on_problems(cfg: DictConfig, run_dir: Path | None, *, hardware: bool = True) -> None:
    found = problems(cfg, run_dir=run_dir, hardware=hardware)
    if found:  # the entry point's message: no traceback, status 1 (Python's for SystemExit(str))
        raise SystemExit(format_problems(found))


def format_sweep_problems(jobs: list[tuple[list[str], Any]], found: dict[int, list[str]]) -> str:
    """One message for a sweep: problems every job shares once, then each bad job with its
    overrides and its own problems."""
    shared = [p for p in found[0] if all(p in f for f in found.values())]
    bad = [i for i, f in found.items() if [p for p in f if p not in shared]]
    n = len(bad) if bad else len(found)
    lines = [
        f"astrai.train: {n} of {len(jobs)} sweep jobs have problems in their config; "
        "nothing was run:"
    ]
    lines += [f"  - every job: {p}" for p in shared]
    swept = swept_overrides([o for o, _ in jobs])
    for i in bad:
        label = " ".join(o for o in jobs[i][0] if o in swept) or "base config"
        lines.append(f"  - job {i} ({label}):")
        lines += [f"      {p}" for p in found[i] if p not in shared]
    return "\n".join(lines)


def format_problems(found: list[str]) -> str:
    """One message with every problem, one per line."""
    n = len(found)
    head = f"astrai.train: {n} problem{'s' if n > 1 else ''} in the config; nothing was run:"
    return "\n".join([head, *(f"  - {p}" for p in found)])


def problems(cfg: DictConfig, *, run_dir: Path | None = None, hardware: bool = True) -> list[str]:
    """Every problem of a composed training config (empty: good to go). `run_dir` is the run
    folder `ckpt_path=last` looks in first (Hydra's `hydra.run.dir`); `hardware=False` skips
    the check of this machine's GPUs (the run happens elsewhere)."""
    inputs = [_with_start_hint(cfg, p) for p in runner.input_problems(cfg)]
    start = _start_problems(cfg)
    if start:  # on-policy data samples from the same missing policy: said once is enough
        init = str(cfg.strategy.init_from)
        inputs = [p for p in inputs if init not in p]
    start += _companion_problems(cfg)
    found = [*inputs, *start, *(_hardware_problems(cfg) if hardware else [])]
    found += _compile_problems(cfg) if hardware else []
    found += _resume_problems(cfg, run_dir)
    found += _logger_problems(cfg)
    found += _serve_policy_problems(cfg)
    found += _engine_problems(cfg)
    if not any(p.startswith(("model", "tokenizer")) for p in inputs):
        found += _vocab_problems(cfg)
        found += _tensor_parallel_problems(cfg)
    if not any(p.startswith("data.train") for p in inputs):
        found += data_problems(cfg, _world_size(cfg.get("trainer") or {}))
    if not found:  # these import Lightning and torch, which the run imports next anyway
        found += _trainer_problems(cfg) + _optim_problems(cfg) + _head_problems(cfg)
    return found


def _head_problems(cfg: DictConfig) -> list[str]:
    """`strategy.logits_chunk_size` (an int >= 1, or null) and `strategy.use_liger_kernel`,
    as the strategy checks them (`astrai.likelihood.logits_head`), before anything loads."""
    strategy = cfg.get("strategy")
    if not OmegaConf.is_dict(strategy) or "logits_chunk_size" not in strategy:
        return []
    from astrai.likelihood import logits_head

    try:
        logits_head(strategy.logits_chunk_size, bool(strategy.get("use_liger_kernel", False)))
    except ValueError as err:
        return [str(err)]
    return []


def _serve_policy_problems(cfg: DictConfig) -> list[str]:
    """`serve_policy`, when on (a port): its settings, and a busy port. Off, nothing is
    imported (`astrai.train.serve_policy` brings torch and Lightning)."""
    block = OmegaConf.select(cfg, "serve_policy")
    if block is None or OmegaConf.select(block, "port") is None:
        return []
    from astrai.train.serve_policy import serve_policy_problems

    return serve_policy_problems(OmegaConf.to_container(block, resolve=True))  # type: ignore[arg-type]


def _engine_problems(cfg: DictConfig) -> list[str]:
    """The run's engine groups (GRPO's rollout engine, the evaluation callback's): their
    `enable_sleep_mode`, which the engine reads only at its first use."""
    from astrai.inference.engine_options import check_sleep_mode

    found = []
    for key in ("strategy.engine", "callbacks.eval.engine"):
        try:
            check_sleep_mode(OmegaConf.select(cfg, f"{key}.enable_sleep_mode", default=False))
        except ValueError as err:
            found.append(f"{key}.{err}")
    return found


# ---------------------------------------------------------------------- hardware
def _experiment(cfg: DictConfig) -> str:
    name = OmegaConf.select(cfg, "hydra.runtime.choices.experiment", default=None)
    return str(name or "NAME")


def _world_size(trainer: Any) -> int:
    return world_size(trainer)  # (astrai.train.memory_plan_config: the plan counts ranks too)


def _hardware_problems(cfg: DictConfig) -> list[str]:
    trainer = cfg.get("trainer") or {}
    accelerator = str(trainer.get("accelerator", "auto")).lower()
    strategy = trainer.get("strategy")
    target = str(strategy.get("_target_", "")) if OmegaConf.is_dict(strategy) else str(strategy)
    fsdp = "fsdp" in target.lower()
    if accelerator not in GPU_ACCELERATORS and not fsdp:
        return []
    gpus = cuda_device_count()
    wanted = f"trainer.accelerator={accelerator}" + (", trainer.strategy=FSDP" if fsdp else "")
    if gpus == 0:
        hint = CPU_SMOKE_HINT.format(experiment=_experiment(cfg))
        return [f"{wanted}: needs CUDA GPUs and this machine has none; {hint}"]
    devices = trainer.get("devices")
    if isinstance(devices, int) and devices > gpus:
        return [
            f"trainer.devices={devices}: this machine has {gpus} GPU(s); pass "
            f"trainer.devices={gpus} (the global batch then shrinks: raise "
            "trainer.accumulate_grad_batches to keep it)"
        ]
    return []


def cuda_device_count() -> int:
    """The CUDA GPUs this process may use. Without an NVIDIA driver (no /proc/driver/nvidia,
    no /dev/nvidiactl) that is 0, found without importing torch (a second or more): a config
    error on a CPU machine is reported at once."""
    if not Path("/proc/driver/nvidia").exists() and not Path("/dev/nvidiactl").exists():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _compile_problems(cfg: DictConfig) -> list[str]:
    if not OmegaConf.select(cfg, "model.compile", default=False):
        return []
    from astrai.model.factory import check_compile_toolchain

    try:
        check_compile_toolchain()
    except RuntimeError as err:
        return [str(err)]
    return []


# ---------------------------------------------------------------------- start and resume
def _producer(path: Path) -> str | None:
    """The experiment whose run writes `path` (`<log_dir>/<name>/latest/export`), if any."""
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "latest" and parts[-1] == "export":
        name = parts[-3]
        if (runner.CONF_DIR / "experiment" / f"{name}.yaml").is_file():
            return name
    return None


def _with_start_hint(cfg: DictConfig, problem: str) -> str:
    """`model.path` unset: say which earlier stage writes the model the strategy starts from."""
    if not problem.startswith("model.path: required"):
        return problem
    target = str(OmegaConf.select(cfg, "strategy._target_", default=""))
    stage = next((s for kind, s in START_STAGES.items() if target.endswith(kind)), None)
    if stage is None:
        return problem
    return (
        f"model.path: required, but not set: the model this run starts from, e.g. the export "
        f"of `python -m astrai.train +experiment={stage} ...` (outputs/{stage}/latest/export) or "
        "a Hugging Face checkpoint directory; pass model.path=<dir>"
    )


def _start_problems(cfg: DictConfig) -> list[str]:
    init = OmegaConf.select(cfg, "strategy.init_from", default=None)
    if not init or Path(str(init)).is_dir():
        return []
    return [
        _missing_export(
            "strategy.init_from",
            Path(str(init)),
            "the export this run starts from",
            "strategy.init_from=null to start from a fresh initialisation",
        )
    ]


def _companion_problems(cfg: DictConfig) -> list[str]:
    """A second model's path (`COMPANION_PATHS`) that is not there."""
    found = []
    for key, (what, instead) in COMPANION_PATHS.items():
        value = OmegaConf.select(cfg, key, default=None)
        if not value or str(value) == "policy" or Path(str(value)).is_dir():
            continue
        found.append(_missing_export(key, Path(str(value)), what, instead))
    return found


def _missing_export(key: str, path: Path, what: str, instead: str) -> str:
    """`key`'s export directory `path` does not exist: the run that writes it, or `instead`."""
    name = _producer(path)
    first = (
        f"run `python -m astrai.train +experiment={name}` first (it writes {path})"
        if name
        else f"pass {key}=<an earlier run's export directory>"
    )
    return f"{key}: {path} does not exist ({what}); {first}, or {instead}"


def _resume_problems(cfg: DictConfig, run_dir: Path | None) -> list[str]:
    value = cfg.get("ckpt_path")
    if value in (None, "", False):
        unasked = runner.unasked_resume(value, run_dir) if run_dir is not None else None
        return [unasked] if unasked else []
    if str(value) == "auto":
        return []
    log_dir, name = Path(str(cfg.paths.log_dir)), str(cfg.name)
    here = run_dir if run_dir is not None else log_dir / name / "<run>"
    try:
        found = runner.resolve_ckpt_path(value, here, log_dir, name)
    except (runner.ConfigPathError, runner.IncompleteCheckpointError) as err:
        return [str(err)]
    if found is None:
        return [runner.nothing_to_resume(here, log_dir, name)]
    return []


def _logger_problems(cfg: DictConfig) -> list[str]:
    if not OmegaConf.select(cfg, "logger.wandb._target_", default=None):
        return []
    problem = wandb_run.mode_problem(OmegaConf.select(cfg, "logger.wandb.mode", default=None))
    return [problem] if problem else []


# ---------------------------------------------------------------------- vocabulary
def _model_vocab(cfg: DictConfig) -> tuple[int, str] | None:
    """The model's vocab_size from its config alone (no weights, no module), or None."""
    shape = model_shape(cfg.get("model"))
    return None if shape is None else (shape.config.vocab_size, shape.source)


def _tensor_parallel_problems(cfg: DictConfig) -> list[str]:
    """`trainer.strategy.tensor_parallel_size` against the model's heads, KV heads,
    intermediate and vocabulary sizes and the number of processes, before anything loads."""
    size = OmegaConf.select(cfg, "trainer.strategy.tensor_parallel_size", default=None)
    if size is None or size == 1:
        return []
    from astrai.train.tensor_parallel import tensor_parallel_problems

    try:
        shape = model_shape(cfg.get("model"))
    except Exception:  # a bad model config is named by _vocab_problems
        return []
    if shape is None:
        return []
    trainer = cfg.get("trainer") or {}
    known = isinstance(trainer.get("devices", 1), int | list)  # not "auto" or -1
    world = _world_size(trainer) if known and trainer.get("devices", 1) != -1 else 0
    return tensor_parallel_problems(shape.config, size, world)


def _vocab_problems(cfg: DictConfig) -> list[str]:
    try:
        found = _model_vocab(cfg)
    except Exception as err:  # a bad model config (unknown preset, field) is a problem too
        return [f"model: {err}"]
    if found is None:
        return []
    vocab, source = found
    tok = cfg.get("tokenizer") or {}
    path = tok.get("path")
    if path:
        from astrai.tokenizer import AutoTokenizer

        n, key = len(AutoTokenizer.from_pretrained(str(path))), "tokenizer.path"
    elif OmegaConf.select(cfg, "tokenizer.train.vocab_size") is not None:
        n, key = int(cfg.tokenizer.train.vocab_size), "tokenizer.train.vocab_size"
    else:
        return []
    if n <= vocab:
        return []
    return [
        f"{key}: the tokenizer has {n} tokens but {source} has vocab_size={vocab}; use "
        f"tokenizer.train.vocab_size<={vocab} or a model with vocab_size >= {n} "
        f"(+model.vocab_size={n})"
    ]


# ---------------------------------------------------------------------- settings
def _trainer_problems(cfg: DictConfig) -> list[str]:
    """Each `trainer` value against the type `lightning.Trainer` declares for it (pydantic,
    strict): `trainer.max_steps=abc` is named here, not by a TypeError from inside Lightning
    once the model is built. Objects (`strategy`, `plugins`) are left to Lightning."""
    node = cfg.get("trainer") or {}
    plain = {}
    for key in node:
        try:  # (an interpolation of Hydra's run folder resolves in a run only)
            value = node[key]
        except Exception:
            continue
        if not str(key).startswith("_") and not OmegaConf.is_dict(value):
            plain[str(key)] = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
    if not plain:
        return []
    import typing

    from lightning.pytorch import Trainer
    from pydantic import TypeAdapter, ValidationError
    from pydantic.errors import PydanticSchemaGenerationError

    hints = typing.get_type_hints(Trainer.__init__)
    found = []
    for key, value in plain.items():
        if key not in hints:
            continue
        try:
            TypeAdapter(hints[key]).validate_python(value, strict=True)
        except PydanticSchemaGenerationError:  # a Lightning class: Lightning checks it
            continue
        except ValidationError:
            hint = hints[key]
            wanted = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            found.append(f"trainer.{key}={value!r}: lightning.Trainer takes {wanted}")
    return found


def _optim_problems(cfg: DictConfig) -> list[str]:
    """The optimizer and its schedule, built on a two-parameter module: torch's own checks
    (`Invalid learning rate: -0.001`) and a stray key, named before the model is built."""
    spec = OmegaConf.select(cfg, "optim")
    if spec is None or "_target_" not in spec:
        return []
    import torch
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    optim: dict[str, Any] = OmegaConf.to_container(spec, resolve=True)  # type: ignore[assignment]
    schedule = optim.pop("schedule", None)
    optim.pop("fused", None)  # a CUDA kernel choice, not a value to check on this machine
    steps = OmegaConf.select(cfg, "trainer.max_steps", default=None)
    try:
        optimizer = instantiate(optim)(torch.nn.Linear(2, 2))
        if schedule and isinstance(steps, int):  # (a bad max_steps is the trainer check's)
            fixed = schedule.get("total_steps")
            fn = instantiate({k: v for k, v in schedule.items() if k != "total_steps"})
            torch.optim.lr_scheduler.LambdaLR(optimizer, fn(total_steps=fixed or steps))
    except (ValueError, TypeError, RuntimeError, InstantiationException) as err:
        # torch's messages, a schedule's, a stray key's, a `_target_` that is not there
        message = str(err.__cause__ or err)
        if message.startswith("optim."):
            return [message]
        return [f"{_keys_with_values(optim, message) or 'optim'}: {message}"]
    except Exception:  # e.g. an AttributeError of an optimizer reading the model's config
        return []
    return []


def _keys_with_values(optim: dict[str, Any], message: str) -> str:
    """The `optim` keys whose number (or a number of whose list) ends `message`, as torch
    quotes the bad value last (`Invalid learning rate: -0.001`)."""
    quoted = set()
    for text in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", message)[-1:]:
        with contextlib.suppress(ValueError):
            quoted.add(float(text))

    def numbers(value: Any) -> list[float]:
        items = value if isinstance(value, list) else [value]
        return [float(x) for x in items if isinstance(x, int | float) and not isinstance(x, bool)]

    keys = [k for k, v in optim.items() if k[0] != "_" and quoted & set(numbers(v))]
    return " / ".join(f"optim.{k}" for k in keys)
