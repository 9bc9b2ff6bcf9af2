"""`astrai.cli_keys`: a group named on the command line wins over every preset (#44.13), dotted
keys under the engine's optional blocks (#44.14), and vLLM's names for them (#54.11)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from astrai.cli_keys import CONF_DIR, NAMED_GROUPS, command_line
from astrai.train.runner import compose

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = [None, *sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))]
SEARCHES = sorted(p.stem for p in (CONF_DIR / "hparams_search").glob("*.yaml"))
PRESETS = [
    [],
    ["debug=fast"],
    ["hardware=cpu_smoke"],
    ["debug=fast", "hardware=cpu_smoke"],
    ["hparams_search={search}"],
]
OPTIONS = {g: sorted(p.stem for p in (CONF_DIR / g).glob("*.yaml")) for g in NAMED_GROUPS}


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _own(group: str, option: str) -> dict[str, Any]:
    """What the option's own file sets (its defaults list aside), leaf by leaf; a required
    value (`???`) sets nothing: a preset may fill it (cpu_smoke's built-in data)."""
    body = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text()) or {}
    body.pop("defaults", None)
    return {k: v for k, v in _leaves(body).items() if v != "???"}


def _text(group: str, option: str) -> str:
    return (CONF_DIR / group / f"{option}.yaml").read_text()


def _experiment_text(option: str) -> str:
    """An experiment's file and those of the experiments its defaults list names (a variant
    like grpo_8b_server keeps its base's overrides)."""
    text = _text("experiment", option)
    defaults = OmegaConf.create(text)
    for entry in defaults.get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            text += _experiment_text(entry)
    return text


def _composed(cfg: Any, group: str) -> dict[str, Any]:
    node = OmegaConf.select(cfg, group.replace("/", "."))
    return _leaves(OmegaConf.to_container(node, resolve=False))


def _lost(cfg: Any, named: dict[str, str]) -> list[str]:
    """The settings of the named options that the composed config does not hold."""
    lost = []
    for group, option in named.items():
        have = _composed(cfg, group)
        for key, value in _own(group, option).items():
            if have.get(key, "<absent>") != value:
                lost.append(f"{group}={option}: {key}={value!r} became {have.get(key)!r}")
    return lost


# ------------------------------------------------------------------------- named groups
def test_the_trainer_named_on_the_command_line_survives_cpu_smoke() -> None:
    """#44.13 as reported: cpu_smoke's one-process trainer replaced fsdp2's strategy."""
    cfg = compose(
        [
            "+experiment=grpo_1b",
            "hardware=cpu_smoke",
            "trainer=fsdp2",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
        ]
    )
    assert cfg.trainer.strategy._target_ == "astrai.train.sharding.FullyShardStrategy"
    assert (cfg.trainer.accelerator, cfg.trainer.devices) == ("cpu", 2)  # key=value wins
    assert cfg.trainer.max_steps == 2 and cfg.trainer.precision == "32-true"  # the smoke's size
    # not named: the presets decide, as before
    cfg = compose(["+experiment=grpo_1b", "hardware=cpu_smoke"])
    assert cfg.trainer.strategy == "auto" and cfg.trainer.devices == 1
    cfg = compose(["+experiment=grpo_1b"])
    assert cfg.trainer.strategy._target_.endswith("DDPStrategy") and cfg.trainer.devices == 8


@pytest.mark.slow  # about a hundred compositions
@pytest.mark.parametrize("e", range(len(EXPERIMENTS)), ids=[str(x) for x in EXPERIMENTS])
def test_a_named_group_wins_over_every_preset(e: int) -> None:
    """Every experiment (and none) with every debug / hardware / search preset, naming one
    option of every group at once (each option of each group is named in some combination):
    every setting the named option's file makes is in the composed config."""
    experiment = EXPERIMENTS[e]
    for p, preset in enumerate(PRESETS):
        i = e * len(PRESETS) + p
        named = {g: opts[(i + k) % len(opts)] for k, (g, opts) in enumerate(OPTIONS.items())}
        if experiment and "/engine@strategy.engine" in _experiment_text(experiment):
            named["strategy"] = "grpo"  # it overrides GRPO's own engine: no other composes
        slots = [s.format(search=SEARCHES[i % len(SEARCHES)]) for s in preset]
        args = [*([f"+experiment={experiment}"] if experiment else []), *slots]
        cfg = compose([*args, *(f"{g}={o}" for g, o in named.items())])
        assert not _lost(cfg, named), (args, _lost(cfg, named))


@pytest.mark.slow  # a subprocess composing through the entry point
def test_the_train_cli_builds_the_named_trainer() -> None:
    args = ["+experiment=grpo_1b", "hardware=cpu_smoke", "trainer=fsdp2", "--cfg", "job"]
    p = subprocess.run(
        [sys.executable, "-m", "astrai.train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    trainer = yaml.safe_load(p.stdout)["trainer"]
    assert trainer["strategy"]["_target_"] == "astrai.train.sharding.FullyShardStrategy"


def test_trainer_tensor_parallel_size_is_the_strategy_key() -> None:
    args = ["trainer=fsdp2", "trainer.accelerator=cpu", "trainer.tensor_parallel_size=2"]
    spelt = command_line("train", args)
    assert spelt[-1] == "trainer.strategy.tensor_parallel_size=2"
    assert compose(spelt).trainer.strategy.tensor_parallel_size == 2
    with pytest.raises(SystemExit, match="tensor_parallel_size"):  # DDP has no such key
        command_line("train", ["trainer=ddp", "trainer.tensor_parallel_size=2"])


# ------------------------------------------------------------------------- engine blocks
SPEC = ["engine.speculative.method=ngram", "engine.speculative.num_speculative_tokens=4"]


@pytest.mark.parametrize("command", ["serve", "generate", "eval"])
def test_dotted_keys_of_a_null_engine_block(command: str) -> None:
    """`engine.speculative.method=ngram ...` and `engine.lora.max_loras=4` as users type them;
    with no key under a block it stays null (off)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    base = ["input=i", "output=o"] if command == "generate" else []
    args = command_line(command, [*base, *SPEC, "engine.lora.max_loras=4"])
    none = command_line(command, base)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        engine = hydra_compose(command, overrides=args).engine
        plain = hydra_compose(command, overrides=none).engine
    assert OmegaConf.to_container(engine.speculative) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
    }
    assert OmegaConf.to_container(engine.lora) == {"max_loras": 4}
    assert plain.speculative is None and plain.lora is None


def test_a_spelt_command_line_is_spelt_again_as_it_is() -> None:
    """A DDP rank runs the rewritten command line through `command_line` again."""
    from astrai.cli_keys import engine_blocks

    once = engine_blocks([*SPEC, "strategy.engine.lora.max_loras=2"])
    assert once[:2] == ["engine.speculative={}", "++engine.speculative.method=ngram"]
    assert engine_blocks(once) == once


def test_dotted_engine_keys_in_bench_and_training() -> None:
    from astrai.bench.__main__ import bench_config

    engine = bench_config("engine", command_line("bench", [*SPEC]))["engine"]
    assert engine["speculative"] == {"method": "ngram", "num_speculative_tokens": 4}
    # GRPO's rollout engine and the evaluation callback's: the same group under other keys
    args = [
        "+experiment=tiny_grpo",
        "strategy.engine.speculative.method=ngram",
        "callbacks.eval.engine.lora.max_loras=2",
    ]
    cfg = compose(command_line("train", args))
    assert OmegaConf.to_container(cfg.strategy.engine.speculative) == {"method": "ngram"}
    assert OmegaConf.to_container(cfg.callbacks.eval.engine.lora) == {"max_loras": 2}
    assert cfg.callbacks.eval.engine.speculative is None


def test_a_block_set_elsewhere_keeps_its_other_keys() -> None:
    """A key under a block that a preset or an earlier override filled replaces that key only."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    args = ["engine.speculative={method: ngram, prompt_lookup_max: 3}", *SPEC[1:]]
    args = command_line("serve", args)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        spec = hydra_compose("serve", overrides=args).engine.speculative
    assert OmegaConf.to_container(spec) == {
        "method": "ngram",
        "prompt_lookup_max": 3,
        "num_speculative_tokens": 4,
    }


@pytest.mark.parametrize(
    ("command", "arg", "meant"),
    [
        ("serve", "speculative_config={method:ngram}", "did you mean engine.speculative?"),
        ("generate", "max_loras=4", "did you mean engine.lora.max_loras?"),
        ("eval", "enable_lora=true", "did you mean engine.lora?"),
        ("train", "num_speculative_tokens=3", "strategy.engine.speculative.num_speculative"),
    ],
)
def test_vllm_names_point_to_the_engine_blocks(command: str, arg: str, meant: str) -> None:
    base = {"generate": ["input=i", "output=o"], "train": ["+experiment=tiny_grpo"]}
    with pytest.raises(SystemExit, match=meant.replace("?", r"\?")):
        command_line(command, [*base.get(command, []), arg])
