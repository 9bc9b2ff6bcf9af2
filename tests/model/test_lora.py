import json

import pytest
import torch

from astrai.model import (
    LoRAConfig,
    Transformer,
    inject_lora,
    load_lora,
    merge_lora,
    save_lora,
    save_pretrained,
)
from astrai.model.lora import LoRALinear, read_lora_dir


def trained_lora(model):
    inject_lora(
        model, LoRAConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def test_injection_freezes_base_and_starts_as_identity(tiny_model):
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        before = tiny_model(x)
    inject_lora(tiny_model, LoRAConfig(r=4))
    trainable = [n for n, p in tiny_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert isinstance(tiny_model.layers[0].self_attn.q_proj, LoRALinear)
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(x), before)


def test_merge_equals_adapted_forward(tiny_model):
    trained_lora(tiny_model)
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        adapted = tiny_model(x)
    merge_lora(tiny_model)
    assert not any(isinstance(m, LoRALinear) for m in tiny_model.modules())
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(x), adapted, atol=1e-5, rtol=1e-5)


def test_save_and_load_adapter(tiny_model, tiny_config, tmp_path):
    base_state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    trained_lora(tiny_model)
    save_lora(tiny_model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4
    from safetensors.torch import load_file

    keys = load_file(tmp_path / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    fresh = Transformer(tiny_config)
    fresh.load_state_dict(base_state)
    load_lora(fresh, tmp_path)
    x = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), tiny_model(x))


def test_saved_adapter_files_get_the_umask_mode(tiny_model, tmp_path):
    """Other users (a server running as another user) can read a saved adapter: its files
    get the mode a plain open() gives, not safetensors' 0600."""
    import os

    trained_lora(tiny_model)
    old = os.umask(0o027)
    try:
        save_lora(tiny_model, tmp_path)
    finally:
        os.umask(old)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name
    assert not list(tmp_path.glob(".*.tmp"))


def test_unknown_target_lists_available(tiny_model):
    with pytest.raises(ValueError, match="q_proj"):
        inject_lora(tiny_model, LoRAConfig(target_modules=["query"]))


def test_save_pretrained_refuses_unmerged(tiny_model, tmp_path):
    inject_lora(tiny_model, LoRAConfig(r=2))
    with pytest.raises(ValueError, match="merge_lora"):
        save_pretrained(tiny_model, tmp_path)


def test_only_adapters_change_in_training(tiny_model):
    base = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    inject_lora(tiny_model, LoRAConfig(r=2))
    opt = torch.optim.SGD([p for p in tiny_model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        loss = tiny_model(torch.randint(0, 97, (2, 8))).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    merge_lora(tiny_model)
    changed = [k for k, v in tiny_model.state_dict().items() if not torch.equal(v, base[k])]
    assert changed and all("_proj" in k for k in changed)


# Each malformed adapter_config.json, and a word of the message naming what is wrong.
MALFORMED_CONFIGS = {
    "array": ("[1, 2]", "expected a JSON object"),
    "string": ('"lora"', "expected a JSON object"),
    "deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "alpha_str": ('{"r": 4, "lora_alpha": "x"}', "lora_alpha: must be a finite number"),
    "alpha_nan": ('{"r": 4, "lora_alpha": NaN}', "lora_alpha: must be a finite number"),
    "alpha_huge": ('{"r": 4, "lora_alpha": 1e300}', "beyond float32's range"),
    "r_str": ('{"r": "4"}', "r: must be a positive int"),
    "r_float": ('{"r": 4.5}', "r: must be a positive int"),
    "r_bool": ('{"r": true}', "r: must be a positive int"),
    "targets_int": ('{"target_modules": 5}', "target_modules: must be a list"),
    "targets_ints": ('{"target_modules": [1, 2]}', "target_modules: must be a list"),
    "targets_empty": ('{"target_modules": []}', "target_modules: must name"),
    "rslora_str": ('{"use_rslora": "yes"}', "use_rslora: must be true or false"),
    "dropout_str": ('{"lora_dropout": "x"}', "lora_dropout: must be a number"),
}


@pytest.mark.parametrize("case", list(MALFORMED_CONFIGS))
def test_malformed_adapter_config_is_a_value_error_naming_the_file(tiny_model, tmp_path, case):
    """`read_lora_dir` (the one reader: `load_lora` here, the engine's adapters) turns each
    malformed config into one ValueError naming the file and the field."""
    trained_lora(tiny_model)
    save_lora(tiny_model, tmp_path)
    text, words = MALFORMED_CONFIGS[case]
    (tmp_path / "adapter_config.json").write_text(text)
    with pytest.raises(ValueError) as err:
        read_lora_dir(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'adapter_config.json'}: ")
    assert words in str(err.value)
    with pytest.raises(ValueError, match=r"adapter_config\.json: "):
        load_lora(Transformer(tiny_model.config), tmp_path)


def test_lora_config_checks_its_fields():
    with pytest.raises(ValueError, match=r"^LoRAConfig\.lora_alpha: 1e\+300 gives a scaling"):
        LoRAConfig(lora_alpha=1e300)
    with pytest.raises(ValueError, match=r"^LoRAConfig\.target_modules: must be a list"):
        LoRAConfig(target_modules="q_proj")  # not ['q', '_', 'p', ...]
    with pytest.raises(ValueError, match=r"^LoRAConfig\.lora_alpha: .* got 'x{27}\.\.\."):
        LoRAConfig(lora_alpha="x" * 10_000)  # the value is quoted cut short
    # what Hydra passes (a ListConfig) and a tuple are lists of names
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"r": 4, "target_modules": ["q_proj", "v_proj"]})
    assert LoRAConfig(**cfg).target_modules == ["q_proj", "v_proj"]
    assert LoRAConfig(target_modules=("o_proj",)).target_modules == ["o_proj"]


def test_peft_regex_target_modules_read_as_the_adapted_modules(tiny_model, tiny_config, tmp_path):
    """PEFT's regex form of `target_modules`: the weights file names the modules."""
    base_state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    trained_lora(tiny_model)
    save_lora(tiny_model, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["target_modules"] = r".*\.(q_proj|v_proj|down_proj)"
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    config, raw, _ = read_lora_dir(tmp_path)
    assert config.target_modules == ["down_proj", "q_proj", "v_proj"]
    assert raw["target_modules"] == cfg["target_modules"]
    fresh = Transformer(tiny_config)
    fresh.load_state_dict(base_state)
    load_lora(fresh, tmp_path)
    x = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), tiny_model(x))
