"""A hostile or diverged LoRA adapter hurts only its own requests (issue #44).

Against the PEFT reference of `peft_adapters`: in a batch that mixes the base, good adapters
and an adapter whose tensors are NaN or inf (loaded, then diverged: the load check cannot
see it), every other request's greedy tokens and log-probs are PEFT's; the same for a
training run's live adapter that diverges after a weight update. At load, what can only
produce NaN (non-finite tensors, a scaling beyond float32) and every malformed
`adapter_config.json` is an `AdapterError` naming the file (and the tensor); a failure while
admitting one request ends that request alone, and the engine serves on.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil

import pytest
import torch
from peft_adapters import (
    TEXTS,
    assert_exact,
    build_dirs,
    build_reference,
    engine_factory,
    greedy,
    peft_adapter,
)
from safetensors.torch import load_file, save_file

from astrai.inference import InferenceEngine
from astrai.inference.adapters import AdapterError, read_adapter
from astrai.model import AutoModel, LoRAConfig, inject_lora
from astrai.model.lora import LoRALinear

POISONS = {"nan": float("nan"), "inf": float("inf")}


@pytest.fixture(scope="module")
def dirs(tokenizer, tmp_path_factory):
    out = build_dirs(tokenizer, tmp_path_factory)
    # PEFT's regex form of target_modules: the weights file says which modules it adapts
    root = tmp_path_factory.mktemp("regex")
    out["regex"] = peft_adapter(
        out["base"], root / "regex", 7, r=4, lora_alpha=8, target_modules=r".*\.(k_proj|up_proj)"
    )
    return out


@pytest.fixture(scope="module")
def reference(dirs):
    return build_reference(dirs)


@pytest.fixture
def make_engine(dirs, tokenizer):
    yield from engine_factory(dirs, tokenizer)


def _run_together(engine: InferenceEngine, jobs: list[tuple[str | None, list[int]]]) -> list:
    """Submit every job with the loop stopped, then start it: the jobs share their steps."""
    engine.stop()
    results = [engine.submit(p, greedy(logprobs_mode="raw"), adapter=a) for a, p in jobs]
    engine.start()
    for result in results:
        with contextlib.suppress(ValueError):  # a failed request: its test looks at it
            result.wait_completion(timeout=60)
    return results


def _poison(tensors, value: float) -> None:
    """Make every A (NaN) or every B (inf) of an adapter non-finite, in place."""
    for a, b in tensors:
        (a if math.isnan(value) else b).fill_(value)


# ---------------------------------------------------------------------- 1. mixed batches
@pytest.mark.slow  # PEFT's reference decoding of several prompts
@pytest.mark.parametrize("poison", list(POISONS))
def test_a_diverged_adapter_changes_no_other_request(make_engine, tokenizer, reference, poison):
    """Row 0 is a base request's and the diverged adapter has the fewest tokens of a step
    (its group is padded): the base's and the good adapters' answers are PEFT's."""
    engine = make_engine(load=("qv", "all", "ours"), start=False)
    hostile = engine.adapters.by_name["ours"]  # loaded clean, then diverged
    _poison(hostile.tensors.values(), POISONS[poison])
    prompts = [tokenizer.encode(t) for t in TEXTS]
    short = prompts[3]
    jobs = [
        (None, prompts[0]),
        ("qv", prompts[1]),
        ("ours", short),
        ("all", prompts[1]),
        (None, prompts[2]),
        ("qv", prompts[0]),
        ("all", prompts[2]),
    ]
    results = _run_together(engine, jobs)
    for (adapter, prompt), result in zip(jobs, results):
        if adapter == "ours":
            assert result.finish_reason == "length"  # it ran; its tokens are its own business
            continue
        assert result.finish_reason == "length", result.task.error
        assert_exact(result.token_ids, result.logprobs, reference(adapter, prompt), str(adapter))
    assert engine.ready


@pytest.mark.slow  # PEFT's reference decoding of several prompts
def test_a_diverged_live_adapter_changes_no_served_adapter(dirs, tokenizer, reference):
    """A training run's live adapter turns NaN on a weight update (the padding, not the load
    check, must hold): the served adapters' answers in the same steps are PEFT's."""
    model = AutoModel.from_pretrained(dirs["base"])
    inject_lora(model, LoRAConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    engine = InferenceEngine(
        model,
        tokenizer,
        max_batch_size=16,
        max_seq_len=128,
        lora={"max_loras": 3, "max_lora_rank": 16},
        start=False,
    )
    try:
        engine.load_adapter("qv", dirs["qv"])
        engine.load_adapter("ours", dirs["ours"])

        def diverge() -> None:
            for module in model.modules():
                if isinstance(module, LoRALinear):
                    module.lora_B.weight.data.fill_(float("nan"))

        engine.update_weights(diverge)
        prompts = [tokenizer.encode(t) for t in TEXTS]
        jobs = [
            ("qv", prompts[0]),
            (None, prompts[3]),  # the live adapter, the fewest tokens
            ("ours", prompts[1]),
            ("qv", prompts[2]),
            ("ours", prompts[0]),
        ]
        results = _run_together(engine, jobs)
        for (adapter, prompt), result in zip(jobs, results):
            assert result.finish_reason == "length", result.task.error
            if adapter is not None:
                want = reference(adapter, prompt)
                assert_exact(result.token_ids, result.logprobs, want, adapter)
        assert engine.ready
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------- 2. refused at load
def _copy(src, dst, **config):
    """A copy of adapter directory `src` with `config` keys changed in its config."""
    shutil.copytree(src, dst)
    data = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**data, **config}))
    return dst


def test_a_scaling_beyond_float32_is_refused_naming_the_file(make_engine, dirs, tmp_path):
    """`lora_alpha: 1e300` used to load and then crash the engine's loop at its first use."""
    engine = make_engine()
    bad = _copy(dirs["qv"], tmp_path / "huge", lora_alpha=1e300)
    with pytest.raises(AdapterError) as err:
        engine.load_adapter("huge", bad)
    msg = str(err.value)
    assert str(bad / "adapter_config.json") in msg
    assert "lora_alpha" in msg and "float32" in msg
    assert engine.list_adapters() == []


@pytest.mark.parametrize("poison", list(POISONS))
def test_non_finite_tensors_are_refused_naming_the_tensor(make_engine, dirs, tmp_path, poison):
    engine = make_engine()
    bad = tmp_path / "bad"
    shutil.copytree(dirs["qv"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = sorted(tensors)[3]
    tensors[key][0, 0] = POISONS[poison]
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(AdapterError) as err:
        engine.load_adapter("bad", bad)
    msg = str(err.value)
    assert str(bad / "adapter_model.safetensors") in msg and key in msg
    assert "NaN or inf" in msg
    assert engine.list_adapters() == []


def test_values_beyond_the_engine_dtype_are_refused(make_engine, dirs, tmp_path):
    """Finite in the file's float32, inf in a float16 engine: refused, naming the tensor."""
    bad = tmp_path / "wide"
    shutil.copytree(dirs["qv"], bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = sorted(tensors)[0]
    tensors[key][0, 0] = 1e6  # float16 tops out at 65504
    save_file(tensors, bad / "adapter_model.safetensors")
    shapes = make_engine().adapters.slots.shapes
    read_adapter(bad, shapes, 16)  # as stored (float32): fine
    with pytest.raises(AdapterError, match=r"beyond the range of the engine's torch\.float16") as e:
        read_adapter(bad, shapes, 16, torch.float16)
    assert key in str(e.value)
    _, pairs = read_adapter(dirs["qv"], shapes, 16, torch.float16)
    assert all(a.dtype == b.dtype == torch.float16 for a, b in pairs.values())


MALFORMED = {  # adapter_config.json text, and a word of the message
    "a JSON array": ("[1, 2]", "expected a JSON object"),
    "a JSON string": ('"lora"', "expected a JSON object"),
    "100,000-deep nesting": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "not UTF-8": (b"\xff\xfe{", "not valid JSON"),
    "an int of 5,000 digits": ('{"r": ' + "9" * 5000 + "}", "not valid JSON"),
}
BAD_FIELDS = {  # one field of a good config changed
    "lora_alpha": "x",
    "r": "4",
    "target_modules": 5,
    "use_rslora": "yes",
    "lora_dropout": [],
    "alpha_pattern": {"q_proj": 64},
    "use_dora": True,
}


def test_malformed_configs_are_adapter_errors_naming_the_file(make_engine, dirs, tmp_path):
    engine = make_engine()
    cases = {name: text for name, (text, _) in MALFORMED.items()}
    words = {name: word for name, (_, word) in MALFORMED.items()}
    good = json.loads((dirs["qv"] / "adapter_config.json").read_text())
    for field, value in {**BAD_FIELDS, "lora_alpha ": float("nan"), "r ": True}.items():
        name = f"{field.strip()}={value!r}"
        cases[name] = json.dumps({**good, field.strip(): value})
        words[name] = field.strip()
    for i, (name, text) in enumerate(cases.items()):
        bad = tmp_path / f"case{i}"
        shutil.copytree(dirs["qv"], bad)
        write = (bad / "adapter_config.json").write_bytes
        write(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(AdapterError) as err:
            engine.load_adapter(f"case{i}", bad)
        msg = str(err.value)
        assert str(bad / "adapter_config.json") in msg, name
        assert words[name] in msg, (name, msg)
        assert len(msg) < 400, name  # a hostile value is not echoed back whole
    assert engine.list_adapters() == []
    engine.load_adapter("qv", dirs["qv"])  # the engine is unharmed


def test_peft_regex_target_modules_load(make_engine, tokenizer, reference):
    """PEFT's regex form of `target_modules` (a string) is no malformed field."""
    engine = make_engine(load=["regex"])
    prompt = tokenizer.encode(TEXTS[0])
    (out,) = engine.run_batch([prompt], greedy(), return_details=True, adapter="regex")
    assert_exact(out.token_ids, out.logprobs, reference("regex", prompt), "regex")
    assert out.token_ids != reference(None, prompt)[0]


# ---------------------------------------------------------------------- 3. admission faults
class _FailingCopy(dict):
    """An adapter's weights whose copy into a slot fails halfway (the first projection is
    already zeroed when it raises)."""

    def get(self, key, default=None):
        raise RuntimeError("injected slot copy failure")


def test_a_failure_while_admitting_fails_only_that_request(
    make_engine, tokenizer, reference, monkeypatch
):
    """One slot: `qv` holds it, then `ours` fails to move in. `ours` ends `aborted` with
    the cause; the others finish as PEFT's, the loop serves on, and `qv` is not served
    from the half-overwritten slot."""
    engine = make_engine(load=("qv", "ours"), lora={"max_loras": 1, "max_lora_rank": 16})
    prompts = [tokenizer.encode(t) for t in TEXTS]
    broken = engine.adapters.by_name["ours"]
    monkeypatch.setattr(broken, "weights", lambda: _FailingCopy())
    jobs = [(None, prompts[0]), ("qv", prompts[1]), ("ours", prompts[2]), (None, prompts[3])]
    results = _run_together(engine, jobs)
    for (adapter, prompt), result in zip(jobs, results):
        if adapter == "ours":
            assert result.finish_reason == "aborted"
            assert "injected slot copy failure" in result.task.error
            continue
        assert result.finish_reason == "length", result.task.error
        assert_exact(result.token_ids, result.logprobs, reference(adapter, prompt), str(adapter))
    assert engine.ready
    assert engine.adapters.slots.users == [0]
    # the next requests of other clients run, on the loop and in run_batch
    later = [engine.submit(p, greedy(), adapter="qv") for p in prompts[:2]]
    for prompt, result in zip(prompts, later):
        result.wait_completion(timeout=60)
        assert_exact(result.token_ids, result.logprobs, reference("qv", prompt), "qv after")
    monkeypatch.undo()  # the adapter is sound again: it moves in and runs as PEFT's
    (out,) = engine.run_batch([prompts[2]], greedy(), return_details=True, adapter="ours")
    assert_exact(out.token_ids, out.logprobs, reference("ours", prompts[2]), "ours after")


# ---------------------------------------------------------------------- NoAdapters
def test_no_adapters_is_the_registry_of_an_engine_without_lora(model):
    """`EngineAdapters.build` without settings (and a model without a live adapter) gives
    `NoAdapters`: the base for every request, the errors an engine without LoRA gives."""
    from astrai.inference.adapters import (
        NO_ADAPTER_SLOTS,
        AdapterNotFound,
        EngineAdapters,
        NoAdapters,
    )
    from astrai.inference.params import SamplingParams
    from astrai.inference.task import Task

    none = EngineAdapters.build(model, None)
    assert isinstance(none, NoAdapters) and not none.enabled and none.list() == []
    assert none.resolve(None) is None and none.slots is NO_ADAPTER_SLOTS
    with pytest.raises(AdapterNotFound, match=r"adapter 'qv': this engine serves no LoRA"):
        none.resolve("qv")
    with pytest.raises(AdapterError, match=r"lora=\.\.\., engine\.lora"):
        none.load("qv", "/nowhere")
    with pytest.raises(AdapterError, match=r"serves no LoRA"):
        none.unload("qv", lambda adapter: False)
    task = Task([1, 2], SamplingParams())
    with none.lock:
        assert none.assign([task]) is None and task.adapter is None
    assert not none.slots.active([task]) and task.adapter_slot == -1
    none.refresh_live()
    none.close()
