"""`python -m astrai.generate`: one output line per input line, in order; bad lines reported."""

import json
import subprocess
import sys

import pytest

from astrai.generate import generate_file
from astrai.inference import InferenceEngine
from astrai.tokenizer import AutoTokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, build_model_dir):
    texts = ["def add(a, b):\n    return a + b\n" * 20, "hello world, the answer is 42\n" * 20]
    return build_model_dir(tmp_path_factory.mktemp("model"), texts)


def write_input(path):
    lines = [
        json.dumps({"prompt": "def add", "id": 1}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        json.dumps({"text": "no prompt field"}),
        json.dumps({"prompt": "hello", "temperature": -1}),
        json.dumps({"prompt": "hello", "seed": 3, "temperature": 1.0}),
    ]
    path.write_text("\n".join(lines) + "\n")


def test_generate_file_keeps_order_and_reports_bad_lines(model_dir, tmp_path):
    from astrai.model import AutoModel

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(src)
    model = AutoModel.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    with InferenceEngine(model, tok, max_batch_size=4) as eng:
        counts = generate_file(eng, src, dst, {"max_tokens": 5, "temperature": 0.0}, progress=False)
        greedy = eng.generate("def add", max_tokens=5, temperature=0.0)
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(rows) == 6 and counts == {
        "lines": 6,
        "ok": 3,
        "errors": 3,
        "completion_tokens": counts["completion_tokens"],
        "failed_lines": [2, 4, 5],
    }
    assert rows[0]["id"] == 1 and rows[0]["completion"] == greedy
    assert rows[1]["error"].startswith("line 2:")
    assert rows[2]["completion_tokens"] <= 3
    assert "line 4" in rows[3]["error"] and "prompt" in rows[3]["error"]
    assert "line 5" in rows[4]["error"] and "temperature" in rows[4]["error"]
    assert "completion" in rows[5]
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("policy", ["error", "clamp"])
def test_a_lines_max_tokens_is_held_to_the_context(model_dir, tmp_path, policy):
    """A line's own max_tokens beyond the context fails that line naming both numbers
    (`clamp`: generates until the context is full); the config's default is capped."""
    from astrai.model import AutoModel

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"prompt": "def add", "max_tokens": 100_000}, {"prompt": "def add"}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    model = AutoModel.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    sampling = {"max_tokens": 100_000, "temperature": 0.0, "ignore_eos": True}
    with InferenceEngine(model, tok, max_batch_size=2, max_seq_len=64) as eng:
        counts = generate_file(eng, src, dst, sampling, progress=False, max_tokens_policy=policy)
    own, default = (json.loads(line) for line in dst.read_text().splitlines())
    assert default["finish_reason"] == "length"
    assert default["prompt_tokens"] + default["completion_tokens"] == 64
    if policy == "clamp":
        assert counts["failed_lines"] == [] and own["finish_reason"] == "length"
        return
    assert counts["failed_lines"] == [1]
    assert own["error"].startswith("line 1: max_tokens: "), own["error"]
    assert "maximum context length is 64 tokens" in own["error"]
    assert f"{default['prompt_tokens'] + 100_000} were requested" in own["error"]


def test_cli(model_dir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(src)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.generate",
            f"model_path={model_dir}",
            f"input={src}",
            f"output={dst}",
            "max_tokens=4",
            "progress=false",
            "engine=contiguous",  # the engine group (conf/engine/), as in serve
            "engine.max_batch_size=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # a failed line fails the batch job; the good lines are still written, the bad ones named
    assert run.returncode == 1, run.stderr[-2000:]
    assert "generated 3 of 6 lines" in run.stdout
    assert "lines 2, 4, 5" in run.stderr and "Traceback" not in run.stderr
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [i for i, row in enumerate(rows, 1) if "error" in row] == [2, 4, 5]
    assert all("completion" in rows[i - 1] for i in (1, 3, 6))


@pytest.mark.slow  # a subprocess loading a model
def test_cli_all_good_lines_exit_zero(model_dir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "def add"}) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.generate",
            f"model_path={model_dir}",
            f"input={src}",
            f"output={dst}",
            "max_tokens=2",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "generated 2 of 2 lines (0 errors" in run.stdout


@pytest.mark.slow  # a subprocess importing torch
def test_model_directory_key_is_named(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "astrai.generate", f"model.path={tmp_path}", "input=i", "output=o"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and f"model_path={tmp_path}" in run.stderr
    assert "not in struct" not in run.stderr


def test_missing_input_is_named(model_dir, tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.generate",
            f"model_path={model_dir}",
            f"input={tmp_path / 'nope.jsonl'}",
            f"output={tmp_path / 'o.jsonl'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "nope.jsonl" in run.stderr
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow  # two subprocesses loading a model
def test_cli_with_speculative_decoding_writes_the_same_lines(model_dir, tmp_path):
    """`engine.speculative` reaches batch generation through the engine group: the same
    greedy and seeded completions as without it."""
    src = tmp_path / "in.jsonl"
    lines = [
        {"prompt": "def add(a, b):\n    return a + b\n" * 3, "temperature": 0},
        {"prompt": "hello world, the answer is 42\n" * 3, "temperature": 0},
        {"prompt": "hello world", "seed": 7, "temperature": 1.0},
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    outputs = {}
    for name, extra in (("off", []), ("on", ["engine.speculative={method: ngram}"])):
        dst = tmp_path / f"{name}.jsonl"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "astrai.generate",
                f"model_path={model_dir}",
                f"input={src}",
                f"output={dst}",
                "max_tokens=24",
                "progress=false",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        outputs[name] = [json.loads(line)["completion"] for line in dst.read_text().splitlines()]
    assert outputs["on"] == outputs["off"]


def _generate(*args, env=None):
    import os

    return subprocess.run(
        [sys.executable, "-m", "astrai.generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


@pytest.mark.slow  # a subprocess
def test_a_missing_output_is_named_before_torch_loads(model_dir, tmp_path):
    """#54.9: `generate` without `output=` fails in one line before torch is imported (it
    used to fail after loading the model, with Hydra's MissingMandatoryValue traceback)."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "def add"}) + "\n")
    run = _generate(f"model_path={model_dir}", f"input={src}", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert run.returncode != 0 and "generate: output=<file.jsonl> required" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()}
    assert "hydra" in imported and "torch" not in imported


@pytest.mark.slow  # a subprocess loading a model
def test_dotted_keys_of_the_engines_optional_blocks(model_dir, tmp_path):
    """#44.14: `engine.speculative.*` and `engine.lora.*` as users type them; a bad value
    under them is one line before the model loads."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "def add"}) + "\n")
    common = [f"model_path={model_dir}", f"input={src}", f"output={dst}", "progress=false"]
    spec = ["engine.speculative.method=ngram", "engine.speculative.num_speculative_tokens=4"]
    run = _generate(*common, *spec, "engine.lora.max_loras=2", "max_tokens=6")
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = [json.loads(line) for line in dst.read_text().splitlines()]
    assert row["completion_tokens"] == 6
    bad = _generate(*common, "engine.speculative.method=ngrm")
    assert bad.returncode != 0 and "engine.speculative.method" in bad.stderr
    assert "Traceback" not in bad.stderr and "KV cache" not in bad.stderr + bad.stdout
