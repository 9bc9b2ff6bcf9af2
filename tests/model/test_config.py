import json

import pytest
import torch

from astrai.model import PRESETS, ConfigError, ModelConfig, Transformer, preset


def test_json_round_trip(tmp_path):
    cfg = ModelConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        rope_scaling={"type": "linear", "factor": 2.0},
        qk_norm=True,
    )
    cfg.save(tmp_path / "config.json")
    back = ModelConfig.load(tmp_path / "config.json")
    assert back == cfg
    assert back.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "astrai"


def test_defaults_derive_head_dim_and_kv_heads():
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=64,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=4,
    )
    assert cfg.head_dim == 16
    assert cfg.num_key_value_heads == 4


def test_missing_field_is_named():
    data = dict(PRESETS["tiny"])
    del data["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dict(data)


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_size", "64"),
        ("tie_word_embeddings", 1),
        ("rms_norm_eps", None),
        ("vocab_size", 3.5),
    ],
)
def test_wrong_type_is_named(field, value):
    data = {**PRESETS["tiny"], field: value}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(data)


def test_unknown_field_is_named():
    with pytest.raises(ConfigError, match="hiden_size"):
        ModelConfig.from_dict({**PRESETS["tiny"], "hiden_size": 3})


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"rope_scaling": {"rope_type": "ntk"}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_inconsistent_values_are_named(overrides, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict({**PRESETS["tiny"], **overrides})


def test_bad_json_file_is_named(tmp_path):
    file = tmp_path / "config.json"
    file.write_text("{not json")
    with pytest.raises(ConfigError, match=str(file)):
        ModelConfig.load(file)


def test_unknown_preset_lists_choices():
    with pytest.raises(KeyError, match="astrai-1b"):
        preset("nope")


def test_1b_preset_on_meta_device():
    cfg = preset("astrai-1b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (1536, 24, 6912)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 4, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (100000, 32768)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.device.type == "meta" for p in model.parameters())
    n = model.num_parameters()
    assert n == cfg.num_parameters()
    assert 1.0e9 < n < 1.4e9


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_counts_its_parameters(name):
    cfg = preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_parameters() == cfg.num_parameters()


def test_factory_options_are_the_preset_factorys_own():
    """`FACTORY_OPTIONS` (read by torch-free config checks) lists exactly the keyword options
    `preset_model` takes besides config fields, so the two cannot drift apart."""
    import inspect

    from astrai.model import preset_model
    from astrai.model.config import FACTORY_OPTIONS

    params = inspect.signature(preset_model).parameters.values()
    assert set(FACTORY_OPTIONS) == {p.name for p in params if p.kind is p.KEYWORD_ONLY}


def test_qwen3_8b_preset_is_the_published_shape():
    """The qwen3-8b preset equals what astrai reads from Qwen3-8B's published config.json (as
    transformers writes it) and counts the parameters transformers' own Qwen3 model has
    (built on the meta device: no weights)."""
    transformers = pytest.importorskip("transformers")
    from astrai.model.hub import config_from_hf

    published = dict(  # Qwen3-8B's config.json: not transformers' Qwen3Config defaults
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    hf = transformers.Qwen3Config(**published)
    ours = preset("qwen3-8b")
    read = config_from_hf(hf.to_dict())
    for field in (*published, "qk_norm", "attention_bias", "rope_scaling"):
        assert getattr(read, field) == getattr(ours, field), field
    with torch.device("meta"):
        reference = transformers.Qwen3ForCausalLM(hf)
    assert ours.num_parameters() == sum(p.numel() for p in reference.parameters())
    assert 8.18e9 < ours.num_parameters() < 8.20e9
