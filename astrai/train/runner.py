"""What `python -m astrai.train` does with its Hydra config, step by step.

1. Check every input path (data, model, tokenizer) so a typo fails before any model is built
   (`python -m astrai.train` has already run all of `astrai.train.preflight`'s checks), and
   log the per-device memory plan (`astrai.train.memory_plan_config`; `plan_only=true`: only that).
2. Tokenizer: an existing directory, or trained once from `tokenizer.train` and cached under
   `${paths.data_dir}/tokenizers/<hash>` (`astrai.train.tokenizer_setup`).
3. Data: the datamodule is connected to the tokenizer and `${paths.data_dir}`
   (`AstraiDataModule.connect`); Lightning's `prepare_data` hook then tokenizes every dataset
   spec with a `prepare:` block once into `${paths.data_dir}/prepared/<hash>`.
4. Instantiate strategy (LightningModule), callbacks, loggers and Trainer from
   their `_target_`s, resolve `ckpt_path` (`last` = this run's or the newest run's of this
   experiment, verified whole; an error when there is none or all of that run's are broken;
   `auto` = the same, or a fresh start; temporary files of killed writes go), and
   `trainer.fit`; a fit without a single training batch is an error. W&B's mode, logger and
   resumed run are `astrai.train.wandb_run`'s. The export callback
   writes the `save_pretrained` directory. A run stopped by SIGTERM or SIGINT
   (`InterruptCheckpoint`) exits with 128 + the signal's number once its checkpoint is written.

Hydra composes; Lightning runs. Nothing here re-implements either. Lightning (and
`astrai.train.callbacks`, which imports it) is imported inside `train()` and the logger
factory only: importing it costs about 5 s, which `--cfg job`, `--help`, a config error and
`compose()` (tests, notebooks) should not pay.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from astrai.data.builtin import is_builtin
from astrai.tokenizer import AutoTokenizer
from astrai.train import receipt, wandb_run
from astrai.train.checkpoint import checkpoint_problem, newest_complete, remove_stale_temps
from astrai.train.memory_plan_config import log_plan
from astrai.train.tokenizer_setup import prepare_tokenizer

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT / "conf"
SPLITS = ("train", "val", "test")


class ConfigPathError(FileNotFoundError):
    """A path in the config (data, model, tokenizer) is missing; raised before any model build."""


class IncompleteCheckpointError(ValueError):
    """`ckpt_path` names a file that is cut short or not a checkpoint at all."""


class BrokenCheckpointsError(IncompleteCheckpointError):
    """`ckpt_path=last`/`auto`: every checkpoint of the run to resume is cut short or damaged."""


class CheckpointExistsError(ValueError):
    """The run folder already holds checkpoints and `ckpt_path` is not set (`unasked_resume`)."""


class NothingToResumeError(ConfigPathError):
    """`ckpt_path=last` found no checkpoint (`ckpt_path=auto` starts fresh instead)."""


class NoTrainingBatchesError(RuntimeError):
    """Lightning ended `fit` without a single training batch: too little data for one batch
    per device. Raised so that the run fails instead of ending with no steps and no export."""


#: `ckpt_path` values that search for the checkpoint to resume (see `resolve_ckpt_path`)
RESUME_VALUES = ("last", "auto")


# ---------------------------------------------------------------------- resolvers
def _launch_uid() -> str:
    # One value per launch (a run or a whole sweep): kept in the environment, so the jobs of a
    # sweep and the DDP ranks Lightning starts (children inherit it) agree, while two
    # launches in the same second differ.
    return os.environ.setdefault("ASTRAI_LAUNCH_UID", secrets.token_hex(3))


def new_launch() -> None:
    """Called by `python -m astrai.train`: a fresh launch uid, unless this process is a rank
    that Lightning's DDP launcher started (it must share its parent's run folder). A uid
    inherited from elsewhere (a notebook, a test process, an outer job) is replaced."""
    if "LOCAL_RANK" not in os.environ:
        os.environ["ASTRAI_LAUNCH_UID"] = secrets.token_hex(3)


def register_resolvers() -> None:
    """`${astrai.root:}` (the repository) and `${astrai.uid:}` (unique per run or sweep)."""
    OmegaConf.register_new_resolver("astrai.root", lambda: str(ROOT), replace=True)
    OmegaConf.register_new_resolver("astrai.uid", _launch_uid, replace=True)


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The composed training config (Hydra's compose API), e.g. for tests and notebooks.

    Overrides are Hydra's, as on the command line: `+experiment=NAME` (or `experiment=NAME`),
    `debug=fast` and `hparams_search=optuna` fill the slots that train.yaml's defaults list
    keeps for them.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from astrai.cli_keys import named_groups_win, normalise_experiment

    register_resolvers()
    overrides = normalise_experiment(overrides or [])
    named_groups_win(overrides)  # a group named here wins over the presets, as on the CLI
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("train", overrides=overrides, return_hydra_config=True)


# ---------------------------------------------------------------------- helpers
def _container(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg


def _get(cfg: DictConfig, key: str, where: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=True)
    except MissingMandatoryValue:
        raise ConfigPathError(f"{where}: required, but not set (pass {where}=<path>)") from None


# ---------------------------------------------------------------------- 1. input checks
def _check_record_source(source: Any, where: str) -> None:
    """A record source (e.g. `astrai.data.OnPolicyPairs`) checks its own inputs when built;
    building it is cheap (the records are made later, by `prepare_data`)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        instantiate(source, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        raise ConfigPathError(f"{where}: {cause}") from None


def input_problems(cfg: DictConfig) -> list[str]:
    """Every configured input that is missing (data, model, tokenizer), one line each naming
    the field: all of them at once, so that one run shows every typo."""
    problems: list[str] = []

    def check(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except ConfigPathError as err:
            problems.append(str(err))

    data = cfg.get("data")
    for split in SPLITS:
        spec = data.get(split) if data is not None else None
        if spec is not None and "sources" in spec and OmegaConf.is_list(spec.sources):
            for i, entry in enumerate(spec.sources):  # a mixture (astrai.data.mixture)
                if OmegaConf.is_dict(entry):
                    check(_check_source, entry, f"data.{split}.sources[{i}].source")
        elif spec is not None:
            check(_check_source, spec, f"data.{split}.source")
    check(_check_model_and_tokenizer, cfg)
    return problems


def _check_source(spec: DictConfig, where: str) -> None:
    source = _get(spec, "source", where)
    if source is None:
        raise ConfigPathError(f"{where}: required, but null")
    if OmegaConf.is_dict(source) and "_target_" in source:
        _check_record_source(source, where)
    elif not is_builtin(source) and not Path(str(source)).exists():
        raise ConfigPathError(f"{where}: {source} does not exist")


def _check_model_and_tokenizer(cfg: DictConfig) -> None:
    model = cfg.get("model") or {}
    if "path" in list(model):  # (`in` on a DictConfig is False for a ??? value)
        path = _get(cfg, "model.path", "model.path")
        if path is not None and not Path(str(path)).is_dir():
            raise ConfigPathError(f"model.path: model directory {path} does not exist")
    tok = cfg.get("tokenizer") or {}
    if "path" in list(tok):
        path = _get(cfg, "tokenizer.path", "tokenizer.path")
        if path is not None and not Path(str(path)).exists():
            raise ConfigPathError(f"tokenizer.path: tokenizer directory {path} does not exist")
        if path is None and not tok.get("train"):
            raise ConfigPathError("tokenizer: set tokenizer.path or a tokenizer.train block")
    corpus = OmegaConf.select(cfg, "tokenizer.train.corpus")
    if corpus is not None and not is_builtin(corpus) and not Path(str(corpus)).exists():
        raise ConfigPathError(f"tokenizer.train.corpus: {corpus} does not exist")


def check_inputs(cfg: DictConfig) -> None:
    """Every configured input must exist: one error naming each missing field, before any work."""
    problems = input_problems(cfg)
    if problems:
        raise ConfigPathError("\n".join(problems))


# ---------------------------------------------------------------------- 4. run
def in_sweep(cfg: DictConfig) -> bool:
    """This job is one of a `-m` sweep's (Hydra's run mode), not a single run."""
    mode = OmegaConf.select(cfg, "hydra.mode", default=None)
    if mode is None:
        from hydra.core.hydra_config import HydraConfig

        mode = HydraConfig.get().mode if HydraConfig.initialized() else None
    return str(mode).endswith("MULTIRUN")


def _instantiate_dict(cfg: Any, what: str) -> list[Any]:
    from hydra.utils import instantiate

    out = []
    for key, spec in (cfg or {}).items():
        if spec is None:
            continue
        if not OmegaConf.is_config(spec):
            raise ValueError(f"{what}.{key}: expected a config with _target_, got {spec!r}")
        if "_target_" not in spec:  # settings left for a callback/logger the group dropped
            log.warning("%s.%s has no _target_ (%s); skipped", what, key, dict(spec))
            continue
        out.append(instantiate(spec, _convert_="all"))
    return out


def resolve_ckpt_path(ckpt_path: Any, output_dir: Path, log_dir: Path, name: str) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start.

    `last`: this run folder's newest whole checkpoint (`last.ckpt`, or `interrupted.ckpt`
    when a signal stopped the run after it); when this folder holds none, the newest whole
    checkpoint of the newest run of experiment `name` under `log_dir`. Each checkpoint is
    verified before it is chosen (`astrai.train.checkpoint`); broken ones are skipped with a
    warning naming them, and when every checkpoint of that run is broken the resume stops
    (`BrokenCheckpointsError`, naming them) rather than take another run's. With no
    checkpoint at all, None: `train` refuses that for `last` (`NothingToResumeError`) and
    starts fresh for `auto`. Any other value is a checkpoint path, which must exist and be
    whole.
    """
    if ckpt_path in (None, "", False):
        return None
    if str(ckpt_path) not in RESUME_VALUES:
        path = Path(str(ckpt_path))
        if not path.exists():
            raise ConfigPathError(f"ckpt_path: {path} does not exist")
        problem = checkpoint_problem(path)
        if problem is not None:
            raise IncompleteCheckpointError(
                f"ckpt_path: {path} is {problem}; pass an earlier one, or ckpt_path=last "
                "for the newest whole one"
            )
        return path
    # newest by modification time: periodic checkpoints are never newer than last.ckpt (written
    # with them), an interruption's checkpoint is newer than both until the run goes on
    own = list((output_dir / "checkpoints").glob("*.ckpt"))
    if own:
        return _newest_whole(own, output_dir, ckpt_path)
    runs: dict[Path, list[Path]] = {}
    for path in (log_dir / name).glob("**/checkpoints/*.ckpt"):
        runs.setdefault(path.parent.parent, []).append(path)
    if not runs:
        return None
    newest = max(runs, key=lambda run: max(p.stat().st_mtime for p in runs[run]))
    return _newest_whole(runs[newest], newest, ckpt_path)


def _newest_whole(candidates: list[Path], run_dir: Path, ckpt_path: Any) -> Path:
    found = newest_complete(candidates)
    if found is not None:
        return found
    broken = ", ".join(f"{p.name} ({checkpoint_problem(p)})" for p in sorted(candidates))
    raise BrokenCheckpointsError(
        f"ckpt_path={ckpt_path}: every checkpoint of run {run_dir} is broken: {broken}; "
        "nothing was resumed (another run's checkpoint would train under this run's config). "
        "Pass ckpt_path=<a checkpoint you choose>, or start fresh in a new run folder"
    )


def unasked_resume(ckpt_path: Any, run_dir: Path) -> str | None:
    """The problem when a run starts without `ckpt_path` in a folder that already holds
    checkpoints (a fixed `hydra.run.dir`, a requeued job): resuming or starting over there
    would both be a guess, so the user says which."""
    if ckpt_path not in (None, "", False):
        return None
    found = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    if not found:
        return None
    return (
        f"hydra.run.dir: {run_dir} already holds checkpoints ({', '.join(found)}) and "
        "ckpt_path is not set; resume them with ckpt_path=last, or start a new run in a new "
        "folder (leave out hydra.run.dir=, or pass another)"
    )


def nothing_to_resume(output_dir: Path, log_dir: Path, name: str) -> str:
    """The error for `ckpt_path=last` when there is no checkpoint, naming the fix."""
    return (
        f"ckpt_path=last: no checkpoint to resume (none in {output_dir / 'checkpoints'} nor "
        f"under {log_dir / name}); start fresh without ckpt_path, or pass ckpt_path=auto "
        "(resume when there is a checkpoint, else start fresh)"
    )


#: strategy keys passed on as plain config, not built by Hydra's recursive instantiation
PLAIN_STRATEGY_KEYS = ("rewards", "environment", "async_rollouts")


def instantiate_strategy(cfg: DictConfig, tokenizer_dir: str | Path | None) -> Any:
    """The strategy LightningModule, built by Hydra recursively (lightning-hydra-template's
    shape): `model` arrives as a model factory, `optimizer` (the `optim` node) and `scheduler`
    (`optim.schedule`) as factories, and nested `_target_` nodes of the strategy itself
    (GRPO's `engine`) as objects or partials. GRPO's `rewards` and `environment` reach the
    strategy as plain config: reward `_target_` entries carry `weight` and `name`, which
    `parse_rewards` takes out before it builds them, and an environment is built once per
    episode."""
    from hydra.utils import instantiate

    optim = dict(_container(cfg.optim))
    schedule = optim.pop("schedule", None)
    spec = OmegaConf.to_container(cfg.strategy, resolve=True)
    plain = {key: spec.pop(key) for key in PLAIN_STRATEGY_KEYS if spec.get(key) is not None}
    build = instantiate(
        spec,
        model=_container(cfg.model),
        optimizer=optim,
        scheduler=schedule,
        tokenizer=str(tokenizer_dir) if tokenizer_dir is not None else None,
        _partial_=True,
        _convert_="all",
    )
    return build(**plain)


def build_run(cfg: DictConfig) -> tuple[Any, Any]:
    """The seeded start of a run: the tokenizer, the data module and the strategy module,
    built in this order after `seed_everything`, so that a replay (`astrai.train.replay`)
    rebuilds exactly the initial weights the run started from."""
    import lightning as L
    from hydra.utils import instantiate

    L.seed_everything(int(cfg.seed), workers=True)
    tokenizer_dir = prepare_tokenizer(cfg.tokenizer, cfg.paths.data_dir)
    # the tokenizer must fit the model: checked on a meta-device model before data preparation
    instantiate(cfg.model)(device="meta", tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir))
    datamodule = instantiate(cfg.data, _convert_="all", _recursive_=False)
    datamodule.connect(tokenizer_dir, cfg.paths.data_dir)
    return datamodule, instantiate_strategy(cfg, tokenizer_dir)


def train(cfg: DictConfig) -> float | None:
    """Run one training job from a composed config; returns `optimized_metric` (sweepers)."""
    from hydra.utils import instantiate
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from astrai.train.callbacks import ExportCallback, InterruptCheckpoint, WandbRunState

    if cfg.get("plan_only"):  # (the entry point stops before this, in preflight)
        log_plan(cfg)
        return None
    check_inputs(cfg)
    paths = cfg.paths
    output_dir, log_dir = Path(paths.output_dir), Path(paths.log_dir)
    unasked = unasked_resume(cfg.get("ckpt_path"), output_dir)
    if unasked:
        raise CheckpointExistsError(unasked)
    ckpt = resolve_ckpt_path(cfg.get("ckpt_path"), output_dir, log_dir, str(cfg.name))
    for folder in {output_dir / "checkpoints", *([ckpt.parent] if ckpt is not None else [])}:
        remove_stale_temps(folder)  # of writes killed in this run's folder or the resumed one
    if ckpt is None and str(cfg.get("ckpt_path")) == "last":
        raise NothingToResumeError(nothing_to_resume(output_dir, log_dir, str(cfg.name)))
    if ckpt is not None:
        log.info("ckpt_path=%s: resuming from %s", cfg.get("ckpt_path"), ckpt)
    elif str(cfg.get("ckpt_path")) == "auto":
        log.info("ckpt_path=auto: no checkpoint under %s; starting from scratch", log_dir)
    log_plan(cfg)  # the per-device memory plan, before the tokenizer, data or model load
    output_dir.mkdir(parents=True, exist_ok=True)
    datamodule, module = build_run(cfg)

    callbacks = _instantiate_dict(cfg.get("callbacks"), "callbacks")
    logger_cfg = OmegaConf.to_container(cfg.get("logger") or {}, resolve=True)
    if logger_cfg.get("wandb"):
        logger_cfg["wandb"]["resume_state"] = wandb_run.read_state(ckpt)
        callbacks.append(WandbRunState(dirpath=output_dir / "checkpoints"))
    loggers = _instantiate_dict(OmegaConf.create(logger_cfg), "logger")
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)

    for lg in loggers:
        with contextlib.suppress(Exception):
            lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    if in_sweep(cfg):  # outputs/latest is a single run's; the sweep's end lists the exports
        for cb in callbacks:
            if isinstance(cb, ExportCallback):
                cb.latest_links, cb.generative_links = [], []
    log.info("output folder: %s", output_dir)
    failed = True
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(ckpt) if ckpt else None)
        failed = False
        receipt.write_after_fit(cfg, trainer, callbacks, output_dir)
    except SIGTERMException:  # a SystemExit with status 0: make the stop visible to schedulers
        receipt.write_after_fit(cfg, trainer, callbacks, output_dir)  # the steps it finished
        stops = [c for c in callbacks if isinstance(c, InterruptCheckpoint)]
        stopped_by = next((c.signal for c in stops if c.signal), signal.SIGTERM)
        if not any(c.saved for c in stops):
            log.warning("stopped by %s; no interruption checkpoint written", stopped_by.name)
        raise SystemExit(128 + int(stopped_by)) from None
    finally:
        wandb_run.finish(loggers, failed=failed)

    if trainer.num_training_batches == 0:
        window = OmegaConf.select(cfg, "data.train.prepare.window_size", default=None)
        packed = OmegaConf.select(cfg, "data.train.prepare.pack", default=False)
        raise NoTrainingBatchesError(
            f"data.train: no training batches (fewer samples than data.batch_size="
            f"{cfg.data.batch_size} per device, with data.drop_last"
            + (f"; records are packed into {window}-token windows" if packed else "")
            + "); lower data.batch_size or give more data"
            + (", or a smaller data.train.prepare.window_size" if packed else "")
            + " (nothing was trained or exported)"
        )
    metric = cfg.get("optimized_metric")
    value = trainer.callback_metrics.get(metric) if metric else None
    return float(value) if value is not None else None
