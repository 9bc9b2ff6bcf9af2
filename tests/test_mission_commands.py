"""The mission's own command lines, verbatim at test size: `python -m astrai.train
+experiment=sft_1b` (on a CPU: `hardware=cpu_smoke`) trains and exports, `python -m
astrai.serve` serves that export to the `openai` SDK, a W&B-tracked `-m` grid runs every job
with its own offline W&B run, the README's headless notebook command writes a notebook a
reader can open, and both experiment spellings compose the same config for every
experiment."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from server_process import free_port, stop, wait_healthy

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
NOTEBOOK = REPO / "notebooks" / "generate.ipynb"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    return {**env, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", **extra}


def _run(args: list[str], *, cwd: Path = REPO, timeout: float = 600, **env: str):
    proc = subprocess.run(
        args, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


def _train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "astrai.train", *args], timeout=timeout)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mission-data")


@pytest.fixture(scope="module")
def sft_1b(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """`python -m astrai.train +experiment=sft_1b hardware=cpu_smoke`: the run folder."""
    tmp = tmp_path_factory.mktemp("sft_1b")
    _train(
        "+experiment=sft_1b",
        "hardware=cpu_smoke",
        f"paths.data_dir={data_dir}",
        f"paths.log_dir={tmp / 'outputs'}",
        f"hydra.run.dir={tmp / 'run'}",
    )
    return tmp / "run"


# ------------------------------------------------------------------------- the spellings
def _cfg_job(spelling: str) -> str:
    proc = _run([sys.executable, "-m", "astrai.train", spelling, "--cfg", "job"], timeout=120)
    return proc.stdout


@pytest.mark.slow
def test_both_spellings_compose_the_same_config_for_every_experiment() -> None:
    """`--cfg job` prints the same config for `+experiment=NAME` and `experiment=NAME`."""
    spellings = [s for name in EXPERIMENTS for s in (f"+experiment={name}", f"experiment={name}")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        printed = dict(zip(spellings, pool.map(_cfg_job, spellings)))
    for name in EXPERIMENTS:
        plus, plain = printed[f"+experiment={name}"], printed[f"experiment={name}"]
        assert f"name: {name}" in plain
        assert plus == plain, name


def test_the_readme_chooses_experiments_with_the_plus_form_first() -> None:
    """Every `python -m astrai.train` command of the README uses `+experiment=`."""
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"python -m astrai\.train[^\n`]*(?:\\\n[^\n`]*)*", readme)
    chosen = [c for c in commands if "experiment=" in c]
    assert chosen, "the README shows no experiment"
    plain = [c for c in chosen if re.search(r"(?<![+\w])experiment=", c)]
    assert not plain, plain
    assert readme.index("+experiment=") < readme.index("`experiment=")


# ------------------------------------------------------------------------- train, serve
@pytest.mark.slow
def test_sft_1b_trains_and_exports_on_a_cpu(sft_1b: Path) -> None:
    import torch

    ckpt = torch.load(sft_1b / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 2
    config = json.loads((sft_1b / "export" / "config.json").read_text())
    # the astrai-1b family (its RoPE base, tied embeddings) at test size
    assert config["rope_theta"] == 500000.0 and config["tie_word_embeddings"] is True
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    assert (sft_1b / "export" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_serve_answers_the_openai_sdk(sft_1b: Path, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "astrai.serve", f"port={port}"],
        cwd=REPO,
        env=_env(ASTRAI_MODEL=str(sft_1b / "export")),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, 180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="export",
            messages=[{"role": "user", "content": "What is 45 + 38?"}],
            max_tokens=8,
            temperature=0,
        )
        assert reply.model == "export" and 0 < reply.usage.completion_tokens <= 8
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        code = stop(server)
        log.close()
    assert code == 0, (tmp_path / "serve.log").read_text()[-3000:]


# ------------------------------------------------------------------------- a W&B grid
@pytest.mark.slow
def test_a_wandb_grid_runs_every_job_with_its_own_offline_run(
    tmp_path: Path, data_dir: Path
) -> None:
    """`-m +experiment=tiny_sft optim.lr=1e-3,3e-3 logger=wandb debug=fast`: both jobs run
    (wandb's own WANDB_MODE=dryrun after job 0 is read as offline), each writes one offline
    W&B run in its folder, the sweep lists its exports and leaves outputs/latest alone."""
    proc = _train(
        "-m",
        "+experiment=tiny_sft",
        "optim.lr=1e-3,3e-3",
        "logger=wandb",
        "debug=fast",
        "model=tiny",
        "tokenizer.train.vocab_size=512",
        "tokenizer.train.max_bytes=400000",
        "data.train.prepare.builtin.n=200",
        "data.val.prepare.builtin.n=32",
        "callbacks.eval.suites.arithmetic.num_prompts=4",
        "callbacks.eval.suites.arithmetic.max_tokens=8",
        "callbacks.eval.at_start=false",
        f"paths.data_dir={data_dir}",
        f"paths.log_dir={tmp_path / 'outputs'}",
        f"hydra.sweep.dir={tmp_path / 'multirun'}",
    )
    out = proc.stdout + proc.stderr
    sweep = tmp_path / "multirun"
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        runs = list((sweep / job / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, (job, runs, out[-3000:])
        assert list(runs[0].glob("*.wandb")), f"job {job}: no W&B run file"
        assert (sweep / job / "export" / "config.json").is_file()
        saved = (sweep / job / ".hydra" / "config.yaml").read_text()
        assert f"lr: {lr}" in saved
        assert f"job {job} (optim.lr={lr}): {sweep / job / 'export'}" in out, out[-3000:]
    assert len({r.name for j in "01" for r in (sweep / j / "wandb").glob("offline-run-*")}) == 2
    assert not (tmp_path / "outputs" / "latest").exists()


# ------------------------------------------------------------------------- the notebook
@pytest.mark.slow
def test_the_readmes_headless_notebook_command_writes_an_executed_notebook(
    tmp_path: Path, build_model_dir
) -> None:
    readme = (REPO / "README.md").read_text()
    (command,) = re.findall(r"`(jupyter execute [^`]+)`", readme)
    texts = ["The sea is calm tonight. 12 + 30 = 42.\n" * 30, "def f(x):\n    return x\n" * 30]
    model = build_model_dir(tmp_path / "model", texts, max_position_embeddings=512)
    # A checkout of its own (the notebook and the ignore rules, committed), so that the
    # command is checked to leave the repository clean: it writes a new, ignored file and
    # never the tracked notebook (nbclient replaces a last suffix such as `.executed`).
    work = tmp_path / "clone"
    (work / "notebooks").mkdir(parents=True)
    shutil.copy(NOTEBOOK, work / "notebooks" / NOTEBOOK.name)
    shutil.copy(REPO / ".gitignore", work / ".gitignore")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    _run([*git, "init", "--quiet"], cwd=work)
    _run([*git, "add", "."], cwd=work)
    _run([*git, "commit", "--quiet", "-m", "notebook"], cwd=work)
    jupyter = Path(sys.executable).with_name("jupyter")
    args = command.split()
    _run([str(jupyter), *args[1:]], cwd=work, timeout=600, ASTRAI_MODEL=str(model))
    status = _run(["git", "status", "--porcelain", "--ignored"], cwd=work).stdout
    # the file the README says the command writes (named after the command, not in it)
    after = readme[readme.index(command) + len(command) :]
    written = re.search(r"notebooks/[^\s`]+\.ipynb", after).group(0)
    assert written != f"notebooks/{NOTEBOOK.name}"
    assert status.splitlines() == [f"!! {written}"], status
    nb = nbformat.read(work / written, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the log-prob plot is missing"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "parameters" in text and "greedy" in text
