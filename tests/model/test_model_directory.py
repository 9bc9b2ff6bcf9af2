"""`astrai.model.directory`: a wrong `model_path` is one line naming what is missing."""

from __future__ import annotations

import pytest

from astrai.model.directory import check_model_dir, model_dir_problem


def make(folder, *names):
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_text("")
    return folder


def test_a_complete_directory_passes(tmp_path):
    folder = make(tmp_path / "m", "config.json", "model.safetensors", "tokenizer.json")
    assert model_dir_problem(folder) is None
    assert check_model_dir(str(folder)) == folder
    sharded = make(tmp_path / "s", "config.json", "model.safetensors.index.json", "tokenizer.json")
    assert model_dir_problem(sharded) is None


def test_a_saved_model_passes(tmp_path, build_model_dir):
    assert model_dir_problem(build_model_dir(tmp_path / "m", ["hello world " * 20])) is None


@pytest.mark.parametrize(
    "names,missing",
    [
        ((), "no config.json, no model.safetensors, no tokenizer.json"),
        (("config.json", "tokenizer.json"), "no model.safetensors ("),
        (("model.safetensors", "tokenizer.json"), "no config.json ("),
        (("config.json", "model.safetensors"), "no tokenizer.json ("),
        (("config.json", "pytorch_model.bin", "tokenizer.json"), "only pickle *.bin / *.pt"),
    ],
)
def test_what_is_missing_is_named(tmp_path, names, missing):
    folder = make(tmp_path / "conf", *names)
    with pytest.raises(SystemExit) as info:
        check_model_dir(str(folder))
    message = str(info.value)
    assert message.startswith(f"model_path={folder}: not a model directory: "), message
    assert missing in message and "save_pretrained or Hugging Face directory" in message
    assert "\n" not in message


def test_a_missing_path_and_a_file_are_named(tmp_path):
    with pytest.raises(SystemExit, match=r"model_path=.*nope: model directory not found"):
        check_model_dir(str(tmp_path / "nope"))
    file = tmp_path / "config.json"
    file.write_text("{}")
    with pytest.raises(SystemExit, match="not a directory"):
        check_model_dir(str(file), key="policy")
    with pytest.raises(SystemExit, match=r"^policy="):
        check_model_dir(str(file), key="policy")


def test_a_reward_model_is_named_with_the_flag_that_serves_it(tmp_path, build_model_dir):
    """`+experiment=tiny_reward` then `make serve`: a reward model's export given where a
    generative model is expected is one line naming `reward_model=`, read from config.json
    alone; as the reward model itself it passes."""
    import torch

    from astrai.model import load_pretrained
    from astrai.model.reward import RewardModel, save_reward_model
    from astrai.tokenizer import AutoTokenizer

    base = build_model_dir(tmp_path / "m", ["hello world " * 20])
    reward = save_reward_model(
        RewardModel.from_backbone(load_pretrained(base, dtype=torch.float32)),
        tmp_path / "export",
        tokenizer=AutoTokenizer.from_pretrained(base),
    )
    with pytest.raises(SystemExit) as info:
        check_model_dir(str(reward))
    message = str(info.value)
    assert message.startswith(
        f"model_path={reward}: a reward model (LlamaForSequenceClassification"
    )
    assert f"python -m astrai.serve reward_model={reward}" in message and "\n" not in message
    assert check_model_dir(str(reward), key="reward_model", generative=False) == reward
    assert model_dir_problem(reward) is None  # the files are all there
    assert check_model_dir(str(base)) == base  # a causal LM passes


def test_a_value_model_is_named_as_ppos_critic(tmp_path, build_model_dir):
    """A PPO export's critic/ given as the model to serve: one line saying it is a value
    model, read from config.json alone."""
    import torch

    from astrai.model import load_pretrained
    from astrai.model.value import ValueModel, save_value_model
    from astrai.tokenizer import AutoTokenizer

    base = build_model_dir(tmp_path / "m", ["hello world " * 20])
    critic = save_value_model(
        ValueModel.from_policy(load_pretrained(base, dtype=torch.float32)),
        tmp_path / "export" / "critic",
        AutoTokenizer.from_pretrained(base),
    )
    assert model_dir_problem(critic) is None  # the files are all there
    with pytest.raises(SystemExit) as info:
        check_model_dir(str(critic))
    message = str(info.value)
    assert message.startswith(f"model_path={critic}: a value model (LlamaForTokenClassification")
    assert "does not generate" in message and "\n" not in message
    assert check_model_dir(str(critic), generative=False) == critic


def test_an_unreadable_config_is_left_to_the_loader(tmp_path):
    folder = make(tmp_path / "m", "config.json", "model.safetensors", "tokenizer.json")
    (folder / "config.json").write_text("{not json")
    assert check_model_dir(str(folder)) == folder
