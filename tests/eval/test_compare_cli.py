"""`python -m astrai.eval compare A B`: the same suites on two exports, paired statistics.

The models are tiny random-weight exports; B is A with its weights perturbed, as a
fine-tuned model is its base plus a change. Sampled suites run at temperature 1, so their
scores depend on the draws, and the draws are what common random numbers pair.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from suite_helpers import write_jsonl

from astrai.data.rewards import REWARDS, register_reward
from astrai.eval.__main__ import CONF_DIR
from astrai.eval.compare import run
from astrai.train.report import difference_ci

TEXTS = ["def add(a, b):\n    return a + b\n" * 20, "Question: What is 2 + 3?\nAnswer: 5\n" * 20]
EVEN = "test_compare_even_length"  # a 0/1 score near one half for a random model's text

if EVEN not in REWARDS:
    register_reward(EVEN)(lambda record, completion: float(len(completion) % 2 == 0))


@pytest.fixture(scope="module")
def models(tmp_path_factory, build_model_dir):
    """Export A (spread-out logits, so its text depends on its weights) and B = A with every
    weight moved by half its own spread (same tokenizer)."""
    root = tmp_path_factory.mktemp("compare")
    a = build_model_dir(root / "A", TEXTS, initializer_range=0.15)
    b = root / "B"
    shutil.copytree(a, b)
    weights = load_file(a / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if w.dtype.is_floating_point and w.numel() > 1:
            noise = torch.randn(w.shape, generator=gen, dtype=torch.float32)
            weights[name] = (w.float() + 0.5 * w.float().std() * noise).to(w.dtype)
    save_file(weights, b / "model.safetensors")
    return a, b


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    rows = [{"prompt": f"Question: What is {i} + {i % 7}?\nAnswer:"} for i in range(96)]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", rows)


def config(a, b, *overrides):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("compare", [f"a={a}", f"b={b}", "device=cpu", "progress=false", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


def sampled(prompts, n_prompts=96):
    """A generation suite at temperature 1 scored by the even-length reward."""
    return [
        f"suites.generation.path={prompts}",
        f"suites.generation.limit={n_prompts}",
        f"suites.generation.metrics=[{EVEN}]",
        "suites.generation.temperature=1.0",
        "suites.generation.max_tokens=4",
    ]


def without_seconds(data):
    """The comparison with the wall-clock times taken out (they differ run to run)."""
    for side in ("a", "b"):
        for suite in data[side]["suites"].values():
            suite.pop("seconds")
    return data


ALL_SUITES = [
    "eval=[perplexity,multiple_choice,generation,code]",
    "suites.perplexity.limit=1",
    "suites.code.limit=2",
    "suites.code.num_samples=2",
    "suites.code.k=[1,2]",
    "suites.code.temperature=1.0",
    "suites.code.max_tokens=8",
]


def test_self_comparison_is_zero_with_a_degenerate_interval(models, prompts, tmp_path):
    a, _ = models
    out = tmp_path / "self.json"
    data = run(config(a, a, *ALL_SUITES, *sampled(prompts, 24), f"out={out}"))
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    stats = {(s, m): v for s, e in data["suites"].items() for m, v in e["stats"].items()}
    assert {("multiple_choice", "acc"), ("generation", EVEN), ("perplexity", "nll")} <= set(stats)
    assert ("code", "pass@2") in stats
    for (suite, metric), s in stats.items():
        assert s["diff"] == 0.0 and s["ci"] == [0.0, 0.0], (suite, metric, s)
        if s["kind"] == "binary":
            assert s["p"] == 1.0 and s["only_a"] == s["only_b"] == 0, (suite, metric, s)
    assert stats[("multiple_choice", "acc")]["kind"] == "binary"
    assert stats[("perplexity", "nll")]["kind"] == "real"
    # every paired record holds the same scores on both sides
    for entry in data["suites"].values():
        assert all(r["a"] == r["b"] for r in entry["samples"])


def assert_same(got, want, path=""):
    """Equal, except that floats may differ by a few float32 ulps (see below) and sandbox
    messages name another temporary folder."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6), (path, got, want)
    elif isinstance(want, str):
        assert SANDBOX_DIR.sub("<dir>", got) == SANDBOX_DIR.sub("<dir>", want), path
    else:
        assert got == want, (path, got, want)


SANDBOX_DIR = re.compile(r"astrai-sandbox-[^/\\]+")  # each program's fresh temporary folder


def test_results_do_not_depend_on_batch_size_or_cache_mode(models, prompts):
    """The paired statistics and records are identical at max_batch_size 1 and 64, paged
    and contiguous; so is every sampled text and every 0/1 score of both models.

    The suites' raw log-likelihoods are not bit-identical: float32 CPU matmuls take
    another kernel for one or two rows than for more (`x[:1] @ W.T` differs from
    `(x @ W.T)[:1]` in the last bit), and the engine projects only continuation positions
    onto the vocabulary, so a request scored alone (batch 1) or after a shared prefix
    (paged, radix cache) rounds differently from one packed with others. The difference is
    one or two float32 ulps of a summed log-prob (about 5e-7 on -12); the sampled tokens and
    the decisions built on the log-probs are the same."""
    a, b = models
    runs = {}
    for engine in ("paged", "contiguous"):
        for batch in (1, 64):
            cfg = config(
                a,
                b,
                *ALL_SUITES,
                *sampled(prompts, 24),
                f"engine={engine}",
                f"engine.max_batch_size={batch}",
            )
            runs[engine, batch] = without_seconds(run(cfg))
    reference = runs["paged", 64]
    assert reference["suites"]["generation"]["stats"][EVEN]["only_a"] > 0  # A and B differ
    for key, data in runs.items():
        assert data["suites"] == reference["suites"], key  # the comparison, exactly
        for side in ("a", "b"):
            # texts and 0/1 scores exactly, log-likelihoods to a few float32 ulps
            assert_same(data[side]["suites"], reference[side]["suites"], f"{key} {side}")


def test_pairing_narrows_the_interval_of_sampled_scores(models, prompts):
    data = run(config(*models, "eval=[generation]", *sampled(prompts)))
    s = data["suites"]["generation"]["stats"][EVEN]
    assert s["kind"] == "binary" and s["n"] == 96
    assert 0.1 < s["a"] < 0.9 and 0.1 < s["b"] < 0.9, s  # the score varies
    paired, unpaired = s["ci"], s["unpaired_ci"]
    assert unpaired == list(difference_ci(s["a"], 96, s["b"], 96))
    message = (
        f"paired {paired} (width {paired[1] - paired[0]:.3f}) vs unpaired Newcombe {unpaired} "
        f"(width {unpaired[1] - unpaired[0]:.3f}); A {s['a']:.3f}, B {s['b']:.3f}, "
        f"only A {s['only_a']}, only B {s['only_b']}"
    )
    assert paired[1] - paired[0] < unpaired[1] - unpaired[0], message
    assert paired[0] <= s["diff"] <= paired[1], message
    print(message)


def test_missing_b_fails_fast_naming_it(models, tmp_path):
    a, _ = models
    missing = tmp_path / "no_such_model"
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.eval", "compare", str(a), str(missing), "eval=[code]"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.perf_counter() - started
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "model B" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout.strip()
    assert seconds < 5, f"took {seconds:.1f} s"


def test_in_process_run_checks_b_before_loading(models, tmp_path, monkeypatch):
    a, _ = models
    import astrai.eval.runner as cli

    monkeypatch.setattr(cli, "evaluate_model", lambda *args, **kw: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit, match=r"model B .*no_such_model: model directory not found"):
        run(config(a, tmp_path / "no_such_model", "eval=[multiple_choice]"))


def test_command_needs_two_models_and_refuses_model_path(models):
    a, _ = models
    for args, message in (
        ([str(a)], "expected two model directories, got 1"),
        ([str(a), str(a), f"model_path={a}"], "not model_path="),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "astrai.eval", "compare", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_cli_writes_the_comparison(models, tmp_path):
    a, b = models
    out = tmp_path / "cmp" / "compare.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.eval",
            "compare",
            str(a),
            str(b),
            "eval=[multiple_choice]",
            f"out={out}",
            "device=cpu",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["a"]["model_path"] == str(a) and data["b"]["model_path"] == str(b)
    acc = data["suites"]["multiple_choice"]["stats"]["acc"]
    records = data["suites"]["multiple_choice"]["samples"]
    # the statistics are those of the per-item records written next to them
    assert acc["n"] == len(records) == len(data["a"]["suites"]["multiple_choice"]["samples"])
    only_b = sum(r["a"]["acc"] == 0 and r["b"]["acc"] == 1 for r in records)
    only_a = sum(r["a"]["acc"] == 1 and r["b"]["acc"] == 0 for r in records)
    assert (acc["only_a"], acc["only_b"]) == (only_a, only_b)
    assert acc["a"] == data["a"]["suites"]["multiple_choice"]["metrics"]["acc"]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("suite"))
    for column in ("B-A", "paired 95% CI", "p (McNemar)", "unpaired CI"):
        assert column in header
    assert any(line.startswith("multiple_choice  acc ") for line in proc.stdout.splitlines())
    assert not list(Path(out.parent).glob(".*.tmp"))


def test_the_gain_comes_from_common_random_numbers(models, prompts):
    """The same two models, B drawing with other seeds than A: the pairs share the prompt
    but not the draws, and the paired interval is about as wide as the unpaired one."""
    from astrai.eval.paired import compare_samples

    a, b = models
    scores = []
    for model, seed in ((a, 0), (b, 1000)):
        data = run(
            config(
                model,
                model,
                "eval=[generation]",
                *sampled(prompts),
                f"suites.generation.seed={seed}",
            )
        )
        scores.append([row[EVEN] for row in data["a"]["suites"]["generation"]["samples"]])
    s = compare_samples(*scores)
    paired, unpaired = s["ci"][1] - s["ci"][0], s["unpaired_ci"][1] - s["unpaired_ci"][0]
    print(f"independent draws: paired width {paired:.3f}, unpaired {unpaired:.3f}")
    assert paired > 0.85 * unpaired, (paired, unpaired)


def test_requests_draw_with_seeds_fixed_by_the_item(tok, prompts):
    """What common random numbers rest on: a suite's request for item i carries the same
    seed whatever the chunking (so on A and on B, whose engines may batch differently)."""
    from suite_helpers import ScriptedEngine

    from astrai.eval import CodeSuite, GenerationSuite

    def seeds(suite, chunk_size, call):
        """{prompt text: the seed its request drew with}."""
        seen = {}

        def reply(text, seed):
            seen[text] = seed
            return ""

        suite.chunk_size = chunk_size
        call(suite, ScriptedEngine(tok, reply))
        return seen

    gen = GenerationSuite(path=str(prompts), seed=5, temperature=1.0, metrics=[])
    by_text = [seeds(gen, c, lambda s, e: s.generate(e)) for c in (1, 7, 256)]
    assert by_text[0] == by_text[1] == by_text[2]
    texts = [tok.decode(ids) for ids in gen.encode(tok)]
    assert [by_text[0][t] for t in texts] == [5 + i for i in range(len(texts))]
    code = CodeSuite(seed=3, temperature=1.0)
    by_task = [seeds(code, c, lambda s, e: s.complete(e)) for c in (1, 256)]
    texts = [tok.decode(tok.encode(t["prompt"])) for t in code.tasks]
    assert by_task[0] == by_task[1]
    assert [by_task[0][t] for t in texts] == [3 + i for i in range(len(texts))]


def test_pairs_are_the_items_scored_on_both_sides():
    from astrai.eval.compare import compare_results
    from astrai.eval.suite import SuiteResult

    def result(scores, where=None):
        rows = [
            {"where": (where or [f"f:{i}" for i in range(len(scores))])[i], "completion": "x"}
            | ({} if s is None else {"exact_match": s, "tokens": 3})
            for i, s in enumerate(scores)
        ]
        values = [s for s in scores if s is not None]
        return SuiteResult("gen", {"exact_match": sum(values) / len(values), "tokens": 3.0}, rows)

    a, b = result([1.0, None, 0.0, 1.0]), result([1.0, 0.0, 1.0, None])
    (entry,) = compare_results([a], [b]).values()
    s = entry["stats"]["exact_match"]
    assert set(entry["stats"]) == {"exact_match"}  # a count is no score
    assert (s["n"], s["a"], s["b"], s["only_b"]) == (2, 0.5, 1.0, 1)
    assert entry["samples"][1] == {"index": 1, "where": "f:1", "a": {}, "b": {"exact_match": 0.0}}
    shifted = result([1.0, 0.0, 1.0, 0.0], where=["f:1", "f:0", "f:2", "f:3"])
    with pytest.raises(ValueError, match=r"item 0: where 'f:0' on A, 'f:1' on B"):
        compare_results([a], [shifted])
    with pytest.raises(ValueError, match="scored 4 items on A and 3 on B"):
        compare_results([a], [result([1.0, 0.0, 1.0])])


def test_positional_arguments_and_hydra_flags():
    from astrai.eval.compare import split_args

    assert split_args(["a", "--cfg", "job", "b", "eval=[code]", "-m"]) == (
        ["a", "b"],
        ["eval=[code]"],
        ["--cfg", "job", "-m"],
    )


@pytest.mark.parametrize("path", ["/m/a,b [x]", "/m/it's", "/m/${x}", "/m/a b"])
def test_model_paths_reach_the_config_verbatim(path):
    from astrai.eval.compare import _quote

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("compare", [f"a={_quote(path)}", f"b={_quote(path)}"])
    assert OmegaConf.to_container(cfg, resolve=True)["a"] == path
