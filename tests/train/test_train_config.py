"""The Hydra config tree composes, and bad input fails early with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import MissingConfigException
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf
from train_helpers import quiet_trainer

from astrai.model import preset
from astrai.train import runner
from astrai.train.runner import ConfigPathError, compose

CONF = runner.CONF_DIR
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
# astrai-1b by hand: 100000 x 1536 tied embedding + 24 x (q, o: 1536^2; k, v: 1536 x 256;
# SwiGLU 3 x 1536 x 6912; 2 norms) + final norm
ASTRAI_1B_PARAMS = (
    100000 * 1536 + 24 * (2 * 1536**2 + 2 * 1536 * 256 + 3 * 1536 * 6912 + 2 * 1536) + 1536
)


def _cfg(*overrides: str):
    return compose([*overrides, "paths.output_dir=/tmp/unused"])


def test_default_is_tiny_pretrain() -> None:
    default, explicit = _cfg(), _cfg("experiment=tiny_pretrain")
    strip = lambda c: OmegaConf.to_container(c, resolve=False)  # noqa: E731
    d, e = strip(default), strip(explicit)
    d.pop("hydra"), e.pop("hydra")
    assert d == e


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes(name: str) -> None:
    cfg = _cfg(f"experiment={name}")
    assert cfg.name == name
    get_class(cfg.strategy._target_)  # importable LightningModule
    assert cfg.trainer._target_ == "lightning.Trainer"
    assert cfg.data._target_ == "astrai.data.AstraiDataModule"
    # the plus spelling (Hydra's docs, the mission's) fills the same slot
    plus = _cfg(f"+experiment={name}")
    assert OmegaConf.to_container(plus) == OmegaConf.to_container(cfg)


def test_required_experiments_exist() -> None:
    assert {"tiny_pretrain", "tiny_sft", "pretrain_1b", "sft_1b"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", ["pretrain_1b", "sft_1b", "dpo_1b", "grpo_1b"])
def test_1b_configs_build_on_meta_with_expected_size(name: str, tmp_path: Path) -> None:
    if name not in EXPERIMENTS:
        pytest.skip(f"{name} not present")
    cfg = _cfg(f"experiment={name}")
    if "path" in list(cfg.model):  # an HF/astrai directory (`???`): a stand-in with the 1B shape
        preset("astrai-1b").save(tmp_path / "config.json")
        cfg.model.path = str(tmp_path)
    model = instantiate(cfg.model)(device="meta")  # the model group is a factory
    assert model.num_parameters() == ASTRAI_1B_PARAMS
    assert cfg.trainer.precision == "bf16-mixed"
    assert cfg.trainer.strategy._target_.split(".")[-1] in ("DDPStrategy", "FSDPStrategy")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_builds_its_optimizer_and_schedule(name: str) -> None:
    """The optim group instantiates to factories whose settings match the functions'
    signatures (a stray key would only fail at the first training step otherwise)."""
    import torch

    from astrai.model import Transformer

    cfg = _cfg(f"experiment={name}")
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    schedule = instantiate(optim.pop("schedule"))
    optimizer = instantiate(optim)(Transformer(preset("tiny", num_hidden_layers=1)))
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert 0.0 <= schedule(total_steps=100)(50) <= 1.0


def test_experiments_pick_their_schedules() -> None:
    targets = {
        name: _cfg(f"experiment={name}").optim.schedule._target_.rsplit(".", 1)[-1]
        for name in ("pretrain_1b", "sft_1b", "grpo_1b", "tiny_grpo", "tiny_dpo")
    }
    assert targets == {
        "pretrain_1b": "wsd",
        "sft_1b": "cosine",
        "grpo_1b": "constant",
        "tiny_grpo": "constant",
        "tiny_dpo": "cosine",
    }
    wsd = _cfg("experiment=pretrain_1b").optim.schedule
    assert (wsd.warmup_steps, wsd.decay_shape, wsd.decay_fraction) == (2000, "sqrt", 0.2)
    assert _cfg("optim=muon").optim.schedule._target_.endswith(".wsd")  # muon's default


def test_new_optimizer_is_a_function_and_a_yaml(tmp_path: Path) -> None:
    """The worked example of docs/training.md: `astrai.train.optim.sgd` plus
    conf/optim/sgd.yaml, selected with `optim=sgd`, trains through the composed config."""
    import torch

    cfg = _cfg(
        "optim=sgd",
        "optim.lr=0.05",
        "optim/schedule=constant",
        "optim.schedule.warmup_steps=4",
        "model=tiny",
        "+model.num_hidden_layers=1",
    )
    module = runner.instantiate_strategy(cfg, None)
    before = {k: v.clone() for k, v in module.model.state_dict().items()}
    ids = torch.randint(0, 512, (8, 16))
    batches = [{"input_ids": row, "labels": row.roll(-1)} for row in ids]
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=2)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=4))
    (optimizer,) = trainer.optimizers
    assert type(optimizer) is torch.optim.SGD
    groups = {g["name"]: g for g in optimizer.param_groups}
    assert groups["hidden"]["momentum"] == 0.9
    assert groups["hidden"]["lr"] == pytest.approx(0.05 * 3 / 4)  # warmup, after 2 steps
    after = module.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_1b_configs_require_user_paths() -> None:
    cfg = _cfg("experiment=pretrain_1b")
    with pytest.raises(ConfigPathError, match=r"data\.train\.source: required"):
        runner.check_inputs(cfg)
    cfg = _cfg("experiment=sft_1b", "data.train.source=/x", "data.val.source=/y")
    with pytest.raises(ConfigPathError, match=r"data\.train\.source: /x does not exist"):
        runner.check_inputs(cfg)


def test_fsdp_trainer_instantiates() -> None:
    cfg = _cfg("experiment=pretrain_1b")
    strategy = instantiate(cfg.trainer.strategy)
    assert type(strategy).__name__ == "FSDPStrategy"


def test_unknown_option_lists_the_choices() -> None:
    with pytest.raises(MissingConfigException) as err:
        _cfg("optim=adamx")
    assert "adamw" in str(err.value) and "muon" in str(err.value)
    with pytest.raises(MissingConfigException) as err:
        _cfg("optim/schedule=poly")
    assert all(name in str(err.value) for name in ("cosine", "wsd", "constant"))
    with pytest.raises(MissingConfigException, match="tiny_sft"):
        _cfg("experiment=tiny_sftt")


def test_missing_paths_fail_before_any_model_is_built(monkeypatch, tmp_path: Path) -> None:
    built = []
    for factory in ("preset_model", "pretrained_model"):
        monkeypatch.setattr(f"astrai.model.{factory}", lambda *a, **k: built.append(1))
    for override, message in [
        (
            "data.train.source=/nope/train.jsonl",
            r"data\.train\.source: /nope/train\.jsonl does not exist",
        ),
        ("data.val.source=/nope/val.h5", r"data\.val\.source: /nope/val\.h5 does not exist"),
        ("model=pretrained", r"model\.path: required"),
        ("tokenizer.path=/nope/tok", r"tokenizer\.path: tokenizer directory /nope/tok"),
    ]:
        cfg = compose([override, f"paths.output_dir={tmp_path}", f"paths.data_dir={tmp_path}"])
        with pytest.raises(ConfigPathError, match=message):
            runner.train(cfg)
    assert not built
    assert not list(tmp_path.iterdir())  # nothing prepared or written


def test_tokenizer_larger_than_model_vocab(tmp_path: Path, data_dir: Path) -> None:
    from astrai.model import VocabMismatchError

    cfg = compose(
        [
            "model=tiny",  # vocab 512
            "tokenizer.train.vocab_size=1024",
            "tokenizer.train.max_bytes=200000",
            "data.train.prepare.builtin.max_bytes=100000",
            "data.val.prepare.builtin.max_bytes=30000",
            f"paths.output_dir={tmp_path}",
            f"paths.data_dir={data_dir}",
            f"paths.log_dir={tmp_path}",
        ]
    )
    with pytest.raises(
        VocabMismatchError,
        match="tokenizer has 1024 tokens but model preset 'tiny' has vocab_size=512",
    ):
        runner.train(cfg)


def test_sweep_dir_is_unique_per_launch(monkeypatch) -> None:
    monkeypatch.delenv("ASTRAI_LAUNCH_UID", raising=False)
    a = runner._launch_uid()
    assert runner._launch_uid() == a  # stable within a launch (all jobs of one sweep)
    monkeypatch.delenv("ASTRAI_LAUNCH_UID")
    assert runner._launch_uid() != a  # another launch
    sweep_dir = OmegaConf.to_container(_cfg().hydra.sweep, resolve=False)["dir"]
    assert "${astrai.uid:}" in sweep_dir


def test_optuna_search_config() -> None:
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    cfg = _cfg("hparams_search=optuna", "experiment=tiny_sft")
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert cfg.hydra.sweeper.direction == "minimize"
    assert set(cfg.hydra.sweeper.params) == {"optim.lr", "optim.weight_decay"}
    assert cfg.optimized_metric == "val/loss"


def test_slurm_launcher_config() -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = _cfg("hydra/launcher=slurm", "experiment=sft_1b", "trainer.num_nodes=2")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.nodes == 2 and launcher.tasks_per_node == cfg.trainer.devices == 8
