"""Exports (links, file modes, a full disk, a LoRA run's adapter) and the throughput token
count."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai.files import DiskFullError
from astrai.train.callbacks import (
    ExportCallback,
    _rows,
    _tokens,
    refresh_link,
    throughput_monitor,
)


def test_refresh_link_repoints_atomically(tmp_path: Path) -> None:
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    (a / "export").mkdir(parents=True)
    (b / "export").mkdir(parents=True)
    link = tmp_path / "outputs" / "latest"
    refresh_link(link, a)
    assert link.resolve() == a.resolve() and (link / "export").is_dir()
    refresh_link(link, b)
    assert link.resolve() == b.resolve()
    assert not list(link.parent.glob(".latest.tmp*"))


def test_throughput_counts_real_tokens_of_the_batch() -> None:
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[0, 6:] = 0
    batch = {"input_ids": torch.zeros(4, 10, dtype=torch.long), "attention_mask": mask}
    assert _rows(batch) == 4
    assert _tokens(batch) == 36  # padding excluded; more than the rows (Throughput checks it)
    pref = {
        "chosen_input_ids": torch.zeros(2, 5),
        "chosen_attention_mask": torch.ones(2, 5),
        "rejected_attention_mask": torch.ones(2, 5),
    }
    assert _rows(pref) == 2 and _tokens(pref) == 20
    monitor = throughput_monitor(window_size=2)
    assert monitor.length_fn(batch) == 36


# ---------------------------------------------------------------------- export
def _module(tmp_path: Path, kind: str = "sft", lora: dict | None = None):
    """A tiny strategy module (random weights) with a tokenizer, as a run would export it."""
    import functools

    from astrai.model import preset_model
    from astrai.tokenizer import AutoTokenizer
    from astrai.train.strategies.reward import RewardModule
    from astrai.train.strategies.sft import SFTModule

    tok = tmp_path / "tok"
    if not tok.is_dir():
        AutoTokenizer.train(["12 + 34 = 46", "hello world"] * 50, vocab_size=280).save_pretrained(
            tok
        )
    vocab = len(AutoTokenizer.from_pretrained(tok))
    cls = RewardModule if kind == "reward" else SFTModule
    torch.manual_seed(0)
    return cls(
        model=functools.partial(preset_model, "tiny", vocab_size=vocab),
        tokenizer=str(tok),
        lora=lora,
    )


def _trainer():
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


@pytest.fixture
def umask_027():
    """A umask other than the usual 022 and 077, so the expected mode (0640) is neither
    what a 0600 writer leaves nor a coincidence."""
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def test_export_files_get_the_umask_mode_not_0600(tmp_path: Path, umask_027) -> None:
    """Before: model.safetensors (safetensors) and the tokenizer files (mkstemp) were 0600,
    unreadable by other users and by containers running as another user; so was a LoRA
    run's adapter."""
    module = _module(tmp_path, lora={"r": 2, "lora_alpha": 4})
    export = tmp_path / "run" / "export"
    ExportCallback(dirpath=export).export(_trainer(), module, export)
    files = [p for p in export.rglob("*") if p.is_file()]
    names = {p.relative_to(export).as_posix() for p in files}
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= names
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= names
    modes = {p.relative_to(export).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(umask_027)}, modes


def test_export_on_a_full_disk_is_one_line_and_keeps_the_old_export(
    tmp_path: Path, monkeypatch
) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    import astrai.model.hub as hub

    module, trainer = _module(tmp_path), _trainer()
    export = tmp_path / "run" / "export"
    ExportCallback(dirpath=export).export(trainer, module, export)
    before = load_file(export / "model.safetensors")
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(1.0)

    def disk_fills(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)  # what got written before the disk filled
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(hub, "save_file", disk_fills)
    with pytest.raises(DiskFullError) as err:
        ExportCallback(dirpath=export).export(trainer, module, export)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{export / 'model.safetensors'}: No space left on device")
    after = load_file(export / "model.safetensors")  # the previous export, whole
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)
    assert not [p.name for p in export.iterdir() if ".tmp" in p.name]


def test_outputs_latest_follows_only_generative_exports(tmp_path: Path) -> None:
    """Before: a reward model's export (strategy=reward) moved outputs/latest, which
    `make serve` then could not serve; it stays reachable as outputs/<name>/latest."""
    outputs = tmp_path / "outputs"
    trainer = _trainer()

    def run(name: str, kind: str) -> Path:
        export = outputs / name / "run" / "export"
        callback = ExportCallback(
            dirpath=export,
            latest_links=[outputs / name / "latest"],
            generative_links=[outputs / "latest"],
        )
        callback.on_train_end(trainer, _module(tmp_path, kind))
        return export.parent

    sft = run("sft", "sft")
    assert (outputs / "latest").resolve() == sft.resolve()
    reward = run("reward", "reward")
    assert (outputs / "reward" / "latest").resolve() == reward.resolve()
    assert (outputs / "reward" / "latest" / "export" / "config.json").is_file()
    assert (outputs / "latest").resolve() == sft.resolve()  # still the generative one


# ---------------------------------------------------------------------- a LoRA run's adapter
def _base(path: Path) -> Path:
    """A tiny random base in the Hugging Face layout (astrai, transformers and PEFT load it)
    with a ChatML tokenizer trained on arithmetic chats."""
    from astrai.data.builtin import builtin_records
    from astrai.model import ModelConfig, Transformer, save_pretrained
    from astrai.tokenizer import AutoTokenizer

    chats = list(builtin_records("arithmetic/sft/train", n=400))
    texts = [" ".join(m["content"] for m in r["messages"]) for r in chats]
    tok = AutoTokenizer.train(texts, vocab_size=320)
    config = ModelConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return save_pretrained(Transformer(config), path, tokenizer=tok, hf_format=True)


@pytest.mark.slow
def test_a_lora_run_exports_an_adapter_the_server_and_peft_load(tmp_path: Path, data_dir) -> None:
    """Before: a LoRA run exported merged weights only, so no command-line route led to an
    adapter directory for `lora_modules`. Now `<export>/adapter` (PEFT's layout) holds it:
    the server's answers with it over the base equal the merged export's, and PEFT's
    `PeftModel.from_pretrained` on the base computes the merged model's logits."""
    import openai
    from server_process import free_port, stop, wait_healthy
    from train_helpers import REPO, cli, run_dirs

    from astrai.data.builtin import builtin_records
    from astrai.inference import InferenceEngine
    from astrai.model import AutoModel
    from astrai.tokenizer import AutoTokenizer

    base = _base(tmp_path / "base")
    cli(
        [
            "experiment=tiny_sft",
            "model=pretrained",
            f"model.path={base}",
            "tokenizer=from_model",
            "strategy.lora={r: 4, lora_alpha: 8}",
            "callbacks.eval=null",
            "callbacks.progress_bar=null",
            "trainer.enable_model_summary=false",
            "trainer.max_steps=30",
            "trainer.val_check_interval=30",
            "trainer.limit_val_batches=1",
            "optim.lr=3e-3",
            "optim.schedule.warmup_steps=0",
            "data.batch_size=8",
            "data.train.prepare.builtin.n=240",
            "data.val.prepare.builtin.n=8",
            *run_dirs(tmp_path, data_dir),
        ]
    )
    export = tmp_path / "run" / "export"
    adapter = export / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    tok = AutoTokenizer.from_pretrained(base)
    questions = ["What is 12 + 35?", "What is 70 - 8?", "What is 41 + 9?", "What is 5 + 5?"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in questions
    ]
    record = next(builtin_records("arithmetic/sft/val", n=1))
    chat = tok.encode(tok.apply_chat_template(record["messages"]))
    merged = InferenceEngine(
        AutoModel.from_pretrained(export), tok, max_batch_size=4, max_seq_len=512
    )
    try:
        expected = [merged.generate(p, max_tokens=12, temperature=0.0) for p in prompts]
    finally:
        merged.shutdown()

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "astrai.serve",
            f"model_path={base}",
            "model_name=base",
            f"port={port}",
            "engine=contiguous",
            "engine.max_batch_size=4",
            "engine.max_seq_len=512",
            f"lora_modules={{mine: '{adapter}'}}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(server, url, 180)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

        def answers(model: str) -> list[str]:
            return [
                client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0.0)
                .choices[0]
                .text
                for p in prompts
            ]

        def scores(model: str) -> torch.Tensor:  # log-probs of a worked answer's tokens
            r = client.completions.create(
                model=model, prompt=[chat], max_tokens=0, echo=True, logprobs=1
            )
            return torch.tensor(r.choices[0].logprobs.token_logprobs[1:])

        served, served_scores = answers("mine"), scores("mine")
        base_scores = scores("base")
    finally:
        stop(server)
    assert served == expected
    # the tokens' log-probabilities too (greedy answers of 30 steps are mostly alike):
    # adapter over the base = merged export, and the adapter is trained (not a no-op)
    with torch.no_grad():
        dense = AutoModel.from_pretrained(export)(torch.tensor([chat]))[0].log_softmax(-1)
    reference = dense[:-1].gather(-1, torch.tensor(chat[1:])[:, None])[:, 0]
    torch.testing.assert_close(served_scores, reference, atol=1e-4, rtol=0)
    assert (served_scores - base_scores).abs().max() > 0.1

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([tok.encode(prompts[0])])
    with torch.no_grad():
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with_adapter = peft.PeftModel.from_pretrained(hf_base, adapter).eval()
        logits = with_adapter(input_ids=ids).logits[0]
        reference = AutoModel.from_pretrained(export)(ids)[0]
    torch.testing.assert_close(logits, reference.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_reward_run_leaves_outputs_latest_to_the_generative_model(
    tmp_path: Path, data_dir
) -> None:
    """The issue's reproduction: `+experiment=tiny_reward` moved outputs/latest to a reward
    model, which `make serve` cannot serve (debug=fast: outputs/debug/ has the same links)."""
    from train_helpers import cli

    outputs = tmp_path / "outputs" / "debug"
    earlier = tmp_path / "earlier_sft_run"
    (earlier / "export").mkdir(parents=True)
    refresh_link(outputs / "latest", earlier)
    cli(
        [
            "+experiment=tiny_reward",
            "data=arithmetic_preference",
            "strategy.init_from=null",
            "debug=fast",
            "tokenizer.train.max_bytes=400000",
            "data.train.prepare.builtin.n=32",
            "data.val.prepare.builtin.n=8",
            "data.batch_size=2",
            "callbacks.progress_bar=null",
            "trainer.enable_model_summary=false",
            f"paths.root_dir={tmp_path}",
            f"paths.data_dir={data_dir}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ]
    )
    assert (outputs / "latest").resolve() == earlier.resolve()
    assert (outputs / "tiny_reward" / "latest").resolve() == (tmp_path / "run").resolve()
    assert (outputs / "tiny_reward" / "latest" / "export" / "config.json").is_file()
