"""Bad checkpoints get errors that name the file, field or tensor, and nothing is written."""

import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai.model import AutoModel, CheckpointError, ConfigError, Transformer, save_pretrained


@pytest.fixture
def saved(tiny_model, tmp_path):
    save_pretrained(tiny_model, tmp_path)
    return tmp_path


def snapshot(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_missing_and_unexpected_tensors_are_listed(saved):
    file = saved / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.7.extra.weight"] = torch.zeros(2)
    save_file(tensors, file, metadata={"format": "pt"})
    before = snapshot(saved)
    with pytest.raises(CheckpointError) as err:
        AutoModel.from_pretrained(saved)
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value)
    assert "model.layers.7.extra.weight" in str(err.value)
    assert snapshot(saved) == before


def test_wrong_shape_names_the_tensor(saved):
    file = saved / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        AutoModel.from_pretrained(saved)


def test_truncated_safetensors_file(saved):
    file = saved / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        AutoModel.from_pretrained(saved)


def test_config_with_missing_field(saved):
    cfg = json.loads((saved / "config.json").read_text())
    del cfg["num_attention_heads"]
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_attention_heads"):
        AutoModel.from_pretrained(saved)


def test_config_with_wrong_type(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["num_hidden_layers"] = "two"
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        AutoModel.from_pretrained(saved)


def test_unsupported_architecture_is_named(saved):
    (saved / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="gpt2"):
        AutoModel.from_pretrained(saved)


def test_pickle_checkpoints_are_refused(tmp_path, tiny_model):
    tiny_model.config.save(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="pickle"):
        AutoModel.from_pretrained(tmp_path)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        AutoModel.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        AutoModel.from_pretrained(tmp_path)


def test_missing_shard_is_named(tiny_model, tmp_path):
    save_pretrained(tiny_model, tmp_path, max_shard_size=20_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        AutoModel.from_pretrained(tmp_path)


def test_save_keeps_unrelated_files(tiny_model, tmp_path):
    (tmp_path / "README.md").write_text("notes")
    save_pretrained(tiny_model, tmp_path)
    assert (tmp_path / "README.md").read_text() == "notes"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_unrepresentable_hf_export_is_refused(tmp_path, tiny_config):
    tiny_config.o_proj_bias = True  # output bias without q/k/v bias: no HF architecture
    model = Transformer(tiny_config)
    with pytest.raises(ConfigError, match="o_proj_bias"):
        save_pretrained(model, tmp_path, hf_format=True)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "olmo2", "phi3", "mixtral"])
def test_an_activation_other_than_silu_is_refused_naming_it(model_type):
    """These families' MLPs are SwiGLU here: a checkpoint with another `hidden_act` would load
    as a different model, so it is refused (Gemma 3 reads its own GeGLU)."""
    from astrai.model.hub import config_from_hf

    data = dict(
        model_type=model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_local_experts=2,
        hidden_act="gelu",
    )
    with pytest.raises(ConfigError, match=r"hidden_act='gelu' is not supported"):
        config_from_hf(data)
    assert config_from_hf(dict(data, hidden_act="silu")).hidden_act == "silu"
