"""The README's journey on a fresh clone: train a tiny model, serve its export, ask the
`openai` SDK. Everything runs as a user would type it, from a `git clone` of this repository
(its committed HEAD), with the commands the README shows."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import free_port, stop, wait_healthy

REPO = Path(__file__).resolve().parents[1]
# Small data so that the tokenizer and corpus are built in seconds (same keys as the train tests).
SMALL = [
    "tokenizer.train.max_bytes=400000",
    "data.train.prepare.builtin.max_bytes=300000",
    "data.val.prepare.builtin.max_bytes=60000",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("git") is None, reason="needs git to clone the repository"),
]


def _env() -> dict[str, str]:
    # The clone's own sources must win over the editable install of this checkout.
    return {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def test_train_serve_and_ask_through_openai(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    clone = tmp_path / "astrai"
    _run(["git", "clone", "--quiet", str(REPO), str(clone)], tmp_path, 120)
    assert not (clone / "outputs").exists() and not (clone / "data").exists()

    # Pretrain (`make train` is `python -m astrai.train`), a few steps of a tiny model,
    # exported in Hugging Face format as the README shows (not debug=fast: its runs go to
    # outputs/debug/, apart from the real runs the README's next steps read).
    _run(
        [sys.executable, "-m", "astrai.train", "model=tiny", "trainer.max_steps=3",
         "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
         "tokenizer.train.vocab_size=512", "callbacks.export.hf_format=true", *SMALL],
        clone,
        600,
    )  # fmt: skip
    pretrained = (clone / "outputs" / "tiny_pretrain" / "latest" / "export").resolve()
    assert (pretrained / "model.safetensors").is_file()
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    assert hf.config.vocab_size == 512

    # Fine-tune from that checkpoint (SFT), with its own tokenizer: 150 steps, where the
    # recipe has learnt the answer format (experiments/tiny_sft: format 1.0 from step 150).
    _run(
        [sys.executable, "-m", "astrai.train", "+experiment=tiny_sft",
         "model=pretrained", "model.path=outputs/tiny_pretrain/latest/export",
         "tokenizer=from_model", "callbacks.eval=null", "trainer.max_steps=150",
         "trainer.val_check_interval=150", "trainer.limit_val_batches=1"],
        clone,
        900,
    )  # fmt: skip
    export = (clone / "outputs" / "latest" / "export").resolve()
    assert export.parent.parent.name == "tiny_sft"
    assert (export / "model.safetensors").is_file() and (export / "tokenizer.json").is_file()

    # Serve: `make serve` is `python -m astrai.serve`, which serves outputs/latest/export.
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "astrai.serve", f"port={port}"],
        cwd=clone,
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, 180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        reply = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "def fib(n):"}],
            max_tokens=12,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert isinstance(choice.message.content, str)
        assert 0 < reply.usage.completion_tokens <= 12
        # Greedy decoding is deterministic: streaming gives the same text.
        stream = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "def fib(n):"}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == choice.message.content
        # The README's question: the fine-tuned model answers in the recipe's format (the
        # number itself needs the full recipe, experiments/tiny_sft).
        answer = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is 45 + 38?"}],
            max_tokens=64,
            temperature=0,
        )
        assert answer.model == model.id
        text = answer.choices[0].message.content
        assert re.search(r"The answer is -?\d+\.", text), text
    finally:
        code = stop(server, signal.SIGTERM)
        log.close()
    assert code in (0, -15), (tmp_path / "serve.log").read_text()[-3000:]
