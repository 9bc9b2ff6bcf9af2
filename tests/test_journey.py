"""The README's journey on a fresh clone: pretrain, fine-tune, plot, serve the fine-tune
while `outputs/latest` points elsewhere, ask the `openai` SDK. Everything runs from a `git clone` of this repository (its
committed HEAD) with the commands the README's journey shows, read from the README itself,
plus only the overrides that make them test-sized."""

from __future__ import annotations

import os
import re
import shlex
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


def journey_commands() -> dict[str, list[str]]:
    """The journey's commands as the README shows them (its own section, in order), by the
    module they run: `astrai.train` (the fine-tune), `astrai.train.plot`, `astrai.serve`."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("## The journey")
    section = readme[start : readme.index("\n## ", start + 1)]
    commands: dict[str, list[str]] = {}
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split("#")[0])
            if words[:2] == ["python", "-m"]:
                commands.setdefault(words[2], words[3:])
    return commands


def test_the_journey_names_the_model_each_step_reads() -> None:
    commands = journey_commands()
    assert set(commands) >= {"astrai.train", "astrai.train.plot", "astrai.serve"}
    finetune, plot, serve = (
        commands[k] for k in ("astrai.train", "astrai.train.plot", "astrai.serve")
    )
    (experiment,) = [a.split("=", 1)[1] for a in finetune if a.startswith("+experiment=")]
    assert plot[0] == f"outputs/{experiment}/latest"
    assert serve == [f"model_path=outputs/{experiment}/latest/export"]


def test_pretrain_finetune_plot_serve_and_ask_through_openai(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    commands = journey_commands()
    clone = tmp_path / "astrai"
    _run(["git", "clone", "--quiet", str(REPO), str(clone)], tmp_path, 120)
    assert not (clone / "outputs").exists() and not (clone / "data").exists()

    # 1. Pretrain (`make train` is `python -m astrai.train`), a few steps of a tiny model,
    # exported in Hugging Face format too (not debug=fast: its runs go to outputs/debug/).
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

    # 2. Fine-tune with the README's command, W&B offline as the README suggests: the tiny
    # model for 150 steps, where it has learnt the answer format (not the sums); the tokenizer
    # step 1 trained is reused.
    finetune = commands["astrai.train"]
    _run(
        [sys.executable, "-m", "astrai.train", *finetune, "logger=wandb", "callbacks.eval=null",
         "trainer.max_steps=150", "trainer.val_check_interval=150",
         "trainer.limit_val_batches=1", "model=tiny", "tokenizer.train.vocab_size=512",
         *SMALL[:1]],
        clone,
        900,
    )  # fmt: skip
    (experiment,) = [a.split("=", 1)[1] for a in finetune if a.startswith("+experiment=")]
    run = (clone / "outputs" / experiment / "latest").resolve()
    assert (run / "export" / "model.safetensors").is_file()
    assert list((run / "wandb").glob("offline-run-*")), "no offline W&B run where the README says"

    # 3. Watch: the README's plot command.
    plot = commands["astrai.train.plot"]
    _run([sys.executable, "-m", "astrai.train.plot", *plot], clone, 300)
    assert (clone / plot[plot.index("--out") + 1]).stat().st_size > 0

    # Another run in between (the old journey's step 2 did one) moves outputs/latest; the
    # serve step names its model, so it serves the fine-tune all the same.
    latest = clone / "outputs" / "latest"
    latest.unlink()
    latest.symlink_to(pretrained.parent)

    # 4. Serve with the README's command.
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "astrai.serve", *commands["astrai.serve"], f"port={port}"],
        cwd=clone,
        env=_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, 180)
        # 5. Ask.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == "export"
        reply = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is 45 + 38?"}],
            max_tokens=64,
            temperature=0,
        )
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length")
        # The fine-tuned model answers in the recipe's format (the number itself needs the
        # full recipe); the pretrained model would answer with code-like text.
        assert re.search(r"The answer is -?\d+\.", choice.message.content), choice.message.content
        assert 0 < reply.usage.completion_tokens <= 64
        # Greedy decoding is deterministic: streaming gives the same text.
        stream = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is 45 + 38?"}],
            max_tokens=64,
            temperature=0,
            stream=True,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == choice.message.content
    finally:
        code = stop(server, signal.SIGTERM)
        log.close()
    assert code in (0, -15), (tmp_path / "serve.log").read_text()[-3000:]
