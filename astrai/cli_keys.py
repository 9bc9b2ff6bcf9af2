"""What every command line goes through before Hydra composes it (`command_line`): one
spelling of the experiment, one name for a model directory, the keys a typo meant.

Experiments: `+experiment=NAME` (Hydra's documentation and the mission's spelling) and
`experiment=NAME` (lightning-hydra-template's) choose the same experiment. conf/train.yaml
keeps `experiment: null` as a slot of its defaults list, placed before `debug` and
`hardware` so that those win over any experiment; Hydra refuses `+group=` for a group the
list already has ("Multiple values for experiment"), so the plus form is read as the slot's
override here, the one place every command shares (`normalise_experiment`).

Model directories: `model_path=<dir>`.

`serve`, `generate` and `eval` read `model_path` from their configs. `train` and `bench`
compose their model from the `model` config group (a preset such as `model=tiny`, or
`model=pretrained model.path=<dir>`); for them `model_path=<dir>` is short for that pair
(and, in training, for `tokenizer=from_model` unless a tokenizer is chosen), so the same
key works everywhere. A key that names a model directory the way another tool or another
command does (`model=<dir>` on serve, `model_dir=`) is refused before Hydra composes,
with the key to use, instead of Hydra's "Key 'model' is not in struct"; any other key the
config lacks gets the keys it may mean (`check_overrides`: `lr` -> `optim.lr`).

Optional engine blocks: conf/engine/ keeps `lora` and `speculative` null (off). A dotted key
under one (`engine.speculative.method=ngram engine.speculative.num_speculative_tokens=4`,
`strategy.engine.lora.max_loras=4` in training) would be refused by Hydra, whose parent is
null; `engine_blocks` spells it as Hydra takes it: the block made a mapping (`={}`, which
leaves a block set elsewhere as it is) and its keys added or replaced (`++`). vLLM's names for
them (`speculative_config=`, `max_loras=`) get the key meant.

Groups named on the command line (train): `+experiment=grpo_1b hardware=cpu_smoke
trainer=fsdp2` builds the fsdp2 trainer. Hydra lets the command line choose the option, but
the presets' values come later in the defaults list and would replace what the option sets
(cpu_smoke's `trainer.strategy: auto` turned fsdp2 back into one process). So every option of
a group the command line names is registered as `chosen/<group>/<option>` (`named_groups_win`),
its own settings (its file without its defaults list), and conf/train.yaml applies the chosen
option's after every preset: what the option's file sets wins; the presets' other values
(steps, sizes) and what they fill in for a required `???` (cpu_smoke's built-in data) still
apply; `key=value` overrides win over both.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CONF_DIR",
    "MODEL_DIR_KEY",
    "NAMED_GROUPS",
    "check_overrides",
    "command_line",
    "engine_blocks",
    "model_args",
    "named_groups_win",
    "normalise_experiment",
]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
MODEL_DIR_KEY = "model_path"
#: config groups that conf/train.yaml keeps as slots of its defaults list (`+NAME=` = `NAME=`)
SLOTS = ("experiment", "hparams_search", "debug", "hardware")
#: groups of conf/train.yaml whose option, named on the command line, wins over the presets
#: (each has a `chosen/<group>` slot at the end of its defaults list: `named_groups_win`)
NAMED_GROUPS = (
    "model",
    "tokenizer",
    "data",
    "strategy",
    "optim",
    "optim/schedule",
    "trainer",
    "logger",
    "callbacks",
)
#: where `named_groups_win` registers the named options (Hydra's ConfigStore)
CHOSEN = "chosen"
#: blocks of conf/engine/ that are null (off) until a key under them is set
ENGINE_BLOCKS = ("lora", "speculative")
#: vLLM's names of engine settings -> the key under an `engine` block that holds them
_VLLM_NAMES = {
    "speculative_config": "speculative",
    "enable_lora": "lora",
    "num_speculative_tokens": "speculative.num_speculative_tokens",
    "max_loras": "lora.max_loras",
    "max_lora_rank": "lora.max_lora_rank",
    "max_cpu_loras": "lora.max_cpu_loras",
}
#: commands composing conf/train.yaml (the ones with the slots above)
_HAS_SLOTS = ("train",)
#: commands that check their options themselves (bench: per benchmark, `bench=<name>`)
_CHECKS_ITS_OPTIONS = ("bench",)
#: keys a command names otherwise: {command: {wrong key: right key}}
_RENAMED = {"prepare": {"tokenizer": "tokenizer_path", "tokenizer.path": "tokenizer_path"}}
#: keys a command no longer has: {command: {key: what to say instead}}
_REMOVED = {
    "serve": {
        "tool_call_format": "removed: tool calls are read by one parser family, chosen with "
        "tool_parser=<name> (vLLM's --tool-call-parser names: hermes, the old default, "
        "llama3_json, mistral, pythonic, qwen3_coder, openai, auto, none, or 'START|END' tags); "
        "docs/serving.md",
    }
}

#: keys other tools use for a model directory (always refused, with the key to use)
_FOREIGN = ("model_dir", "model_name_or_path", "pretrained_model_name_or_path")
#: commands whose config has `model_path` (and no `model` group)
_HAS_MODEL_PATH = ("serve", "generate", "eval")
#: commands that compose `model` from the config group (conf/model/)
_HAS_MODEL_GROUP = ("train", "bench")


def _key(arg: str) -> str | None:
    if arg.startswith("-") or "=" not in arg:  # flags (-m, --cfg job) and their values
        return None
    return arg.split("=", 1)[0].lstrip("+~")


def normalise_experiment(args: Sequence[str]) -> list[str]:
    """`args` with `+experiment=NAME` (and `++`, and the other slots of conf/train.yaml:
    `+debug=fast`, `+hardware=...`, `+hparams_search=...`) read as the slot's override
    `experiment=NAME`, so both spellings compose the same config, sweeps included
    (`-m +experiment=tiny_sft,tiny_dpo`)."""
    out = []
    for arg in args:
        key = _key(arg)
        if key in SLOTS and arg.startswith("+"):
            arg = arg.lstrip("+")
        out.append(arg)
    return out


def engine_blocks(args: Sequence[str]) -> list[str]:
    """`args` with each key under an optional engine block (`<...>engine.speculative.<key>=v`,
    `<...>engine.lora.<key>=v`) spelt so that Hydra takes it while the block is null: the
    block set to `{}` once, before its first key (a mapping already there is kept: Hydra
    merges), and the key given as `++key=v` (added or replaced). Null still means off when
    no key under the block is set."""
    out: list[str] = []
    opened: set[str] = set()
    for arg in args:
        key = _key(arg)
        parts = key.split(".") if key and not arg.startswith("~") else []
        at = next(
            (
                i
                for i in range(1, len(parts) - 1)
                if parts[i] in ENGINE_BLOCKS and parts[i - 1] == "engine"
            ),
            None,
        )
        if at is None:
            if len(parts) > 1 and parts[-1] in ENGINE_BLOCKS and arg.endswith("={}"):
                opened.add(key)  # (a command line spelt here already: a DDP rank's)
            out.append(arg)
            continue
        block = ".".join(parts[: at + 1])
        if block not in opened:
            opened.add(block)
            out.append(f"{block}={{}}")
        out.append("++" + arg.lstrip("+"))
    return out


def named_groups_win(args: Sequence[str], config_dir: Path = CONF_DIR) -> None:
    """Register in Hydra's ConfigStore, as `chosen/<group>/<option>`, the own settings of
    every option of each `NAMED_GROUPS` group that `args` name (`trainer=fsdp2`, and sweeps
    `trainer=ddp,fsdp2`): its file without its defaults list. conf/train.yaml applies the
    chosen option's after every preset, so that no experiment, debug or hardware preset
    replaces what the option the user named sets. The other groups' entries are emptied
    (a process that composes several configs, a test, starts each from the same state)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    named = {_key(a) for a in args}
    store = ConfigStore.instance()
    for group in NAMED_GROUPS:
        for path in sorted((Path(config_dir) / group).glob("*.yaml")):
            own: dict[str, Any] = {}
            if group in named:
                own = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
                own.pop("defaults", None)
            store.store(group=f"{CHOSEN}/{group}", name=path.stem, node=own)


#: trainer-level spellings of strategy options (Lightning's `ModelParallelStrategy` names):
#: every `trainer.<key>` is an argument of `lightning.Trainer`, so the config keeps these on
#: `trainer.strategy` (`trainer=fsdp2`), and `trainer.<key>=v` is read as that key
TRAINER_STRATEGY_KEYS = ("tensor_parallel_size",)


#: top-level spellings of GRPO's strategy blocks: `rollout.mode=server
#: rollout.servers=[...]` (the issue's, and TRL's `vllm_mode`-style) is `strategy.rollout.*`
STRATEGY_BLOCKS = ("rollout",)


def strategy_keys(args: Sequence[str]) -> list[str]:
    """`args` with `trainer.tensor_parallel_size=N` (the issue's, torchtitan's and
    Lightning's name) spelt `trainer.strategy.tensor_parallel_size=N`, as the config has it,
    and `rollout.<key>=v` spelt `strategy.rollout.<key>=v`; under a strategy without the key
    (`trainer=ddp`, a strategy other than GRPO) the override check names it."""
    out = []
    for arg in args:
        key = _key(arg) or ""
        name = key.removeprefix("trainer.")
        if key.startswith("trainer.") and name in TRAINER_STRATEGY_KEYS:
            arg = arg.replace(key, f"trainer.strategy.{name}", 1)
        elif key.split(".", 1)[0] in STRATEGY_BLOCKS:
            arg = arg.replace(key, f"strategy.{key}", 1)
        out.append(arg)
    return out


def renamed_keys(command: str, args: Sequence[str]) -> None:
    """A key that `command` spells otherwise (`tokenizer=` on prepare) is a `SystemExit`
    naming the right one, before Hydra's "Could not override 'tokenizer'"; so is a key it no
    longer has (`tool_call_format=` on serve), saying what replaced it."""
    for arg in args:
        key = _key(arg)
        gone = _REMOVED.get(command, {}).get(key or "")
        if gone:
            raise SystemExit(f"{command}: {key}: {gone}")
        right = _RENAMED.get(command, {}).get(key or "")
        if right:
            value = arg.split("=", 1)[1] or "<dir>"
            raise SystemExit(f"{command}: unknown key {key!r}; did you mean {right}={value}?")


def command_line(command: str, args: Sequence[str], config_name: str | None = None) -> list[str]:
    """The Hydra overrides `command` runs with, from its command line `args`: the experiment
    slots in one spelling (train), `model_path=<dir>` as the command reads it, and every key
    the config lacks or spells otherwise refused at once with the key meant. Every entry
    point calls this, and only this, before `hydra.main` (`sys.argv[1:] = command_line(...)`).
    """
    args = list(args)
    if command in _HAS_SLOTS:
        args = normalise_experiment(args)
        named_groups_win(args)
    renamed_keys(command, args)
    if command == "train":
        args = strategy_keys(args)
    args = engine_blocks(args)
    if command in _HAS_MODEL_PATH + _HAS_MODEL_GROUP:
        args = model_args(command, args)
    if command not in _CHECKS_ITS_OPTIONS:
        check_overrides(command, str(CONF_DIR), config_name or command, args)
    return args


def model_args(command: str, args: Sequence[str]) -> list[str]:
    """`args` (Hydra overrides) with `model_path=<dir>` spelled as `command` reads it; a
    key that is wrong for `command` is a `SystemExit` naming the right one."""
    if command not in _HAS_MODEL_PATH + _HAS_MODEL_GROUP:
        raise ValueError(f"unknown command {command!r}")
    keys = [_key(a) for a in args]
    out: list[str] = []
    for arg, key in zip(args, keys):
        value = arg.split("=", 1)[1] if key else ""
        if key in _FOREIGN:
            raise SystemExit(
                f"{command}: unknown key {key!r}: the model directory is "
                f"{MODEL_DIR_KEY}={value or '<dir>'}"
            )
        if command in _HAS_MODEL_PATH and key in ("model", "model.path"):
            raise SystemExit(
                f"{command}: {key}= is the training config group; the model directory is "
                f"{MODEL_DIR_KEY}={value or '<dir>'}"
            )
        if command in _HAS_MODEL_GROUP and key == MODEL_DIR_KEY:
            if "model" in keys:
                raise SystemExit(
                    f"{command}: give either {MODEL_DIR_KEY}=<dir> or model=<preset>, not both"
                )
            out += ["model=pretrained", f"model.path={value}"]
            if command == "train" and "tokenizer" not in keys:
                out.append("tokenizer=from_model")  # the tokenizer stored with the model
            continue
        out.append(arg)
    return out


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return []
    keys = []
    for key, value in node.items():
        full = f"{prefix}{key}"
        keys.append(full)
        keys += _flat_keys(value, f"{full}.")
    return keys


def _closest(key: str, known: list[str]) -> list[str]:
    leaf = key.rsplit(".", 1)[-1]
    if leaf in _VLLM_NAMES:  # vLLM's spelling: the same setting under each `engine` block
        block, _, rest = _VLLM_NAMES[leaf].partition(".")
        found = [k for k in known if k.endswith(f"engine.{block}") or k == block]
        return [f"{k}.{rest}" if rest else k for k in found][:3]
    same_leaf = [k for k in known if k.rsplit(".", 1)[-1] == leaf and k != key]
    level = [k for k in known if k.count(".") == key.count(".")]  # optim.lrr: not `optim`
    return list(dict.fromkeys(same_leaf + difflib.get_close_matches(key, level, n=3)))[:3]


def check_overrides(command: str, config_dir: str, config_name: str, args: Sequence[str]) -> None:
    """Compose `config_name` with `args` once (a fraction of a second) and turn Hydra's
    "Key 'lr' is not in struct ... use +lr=" into one message naming every unknown key and
    the keys meant (`lr` -> `optim.lr`), with no traceback. Command lines with flags
    (`-m`, `--cfg`, `--config-name`) are left to Hydra, as is every other error."""
    if any(not _key(a) for a in args):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    rest, unknown = list(args), []
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        for _ in range(len(args) + 1):
            try:
                cfg = compose(config_name, overrides=rest, return_hydra_config=True)
                break
            except ConfigCompositionException as err:
                full_key = getattr(err.__cause__, "full_key", None)
                if "not in struct" not in str(err.__cause__) or not full_key:
                    return  # Hydra's own message says it
                bad = [a for a in rest if _key(a) == full_key]
                if not bad:
                    return
                unknown.append(full_key)
                rest = [a for a in rest if a not in bad]
        else:
            return
    if not unknown:
        return
    known = [k for k in _flat_keys(OmegaConf.to_container(cfg)) if not k.startswith("hydra")]
    lines = []
    for key in unknown:
        near = _closest(key, known)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        lines.append(f"  {key}: not a key of {command}{hint}")
    raise SystemExit(
        f"{command}: unknown key{'s' if len(unknown) > 1 else ''} (a key the config lacks is "
        f"added with +key=value):\n" + "\n".join(lines)
    )
