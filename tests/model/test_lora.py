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
from astrai.model.lora import LoRALinear


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
