"""lm-eval's `astrai` model against lm-eval's own `hf` model (transformers) on the HF export
of one tiny random model: the same local tasks (multiple choice, rolling log-likelihood,
generation; YAML + JSONL written here, nothing downloaded) must give the same per-request
log-likelihoods (1e-4), the same greedy flags, the same accuracy and the same text."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from astrai.eval.harness import AstraiLM
from astrai.model import AutoModel, save_pretrained
from astrai.tokenizer import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
MAX_LENGTH = 48  # both models truncate to it: the long docs below cross it
TEXTS = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun",
    "a stitch in time saves nine and an apple a day keeps the doctor away",
    "numbers like 12, 345 and 6789 appear; so do symbols: (x + y) * z = 42!",
] * 20
LONG = " ".join(TEXTS[:3] * 3)  # more than MAX_LENGTH tokens
MC_DOCS = [
    {"question": "the quick brown", "choices": ["fox", "dog", "lazy cat", "sun"], "answer": 0},
    {"question": "an apple a day", "choices": [" keeps", " saves nine"], "answer": 0},
    {"question": LONG + " and then", "choices": [" the dog", " a cat", " 42"], "answer": 2},
    {"question": "(x + y) * z =", "choices": [" 42", " 6789", " nine", " fox"], "answer": 1},
]
GEN_DOCS = [
    {"question": "the quick brown fox", "answer": " jumps"},
    {"question": "a stitch in time", "answer": " saves"},
    {"question": LONG, "answer": " x"},
]


def _task_yaml(name: str, data: Path, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\n{body}"
    )


@pytest.fixture(scope="module")
def export(tmp_path_factory, build_model_dir) -> Path:
    """The HF-format export (weights + tokenizer) of a tiny random model whose weights are
    spread enough that its argmax is never a near tie."""
    root = tmp_path_factory.mktemp("harness")
    src = build_model_dir(
        root / "src",
        TEXTS,
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = AutoModel.from_pretrained(src)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = root / "hf"
    save_pretrained(model, out, tokenizer=AutoTokenizer.from_pretrained(src), hf_format=True)
    return out


@pytest.fixture(scope="module")
def tasks(export) -> Path:
    """Three local tasks: multiple choice, rolling log-likelihood, greedy generation."""
    root = export.parent / "tasks"
    root.mkdir()
    files = {
        "mc": (
            MC_DOCS,
            'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
            'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        ),
        "rolling": (
            [{"text": t} for t in (TEXTS[0], LONG, TEXTS[2])],
            'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
            "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
        ),
        "gen": (
            GEN_DOCS,
            'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: answer\n'
            'generation_kwargs:\n  until: ["\\n", "e"]\n  max_gen_toks: 8\n  do_sample: false\n'
            "metric_list:\n  - metric: exact_match\n",
        ),
    }
    for name, (docs, body) in files.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{name}.yaml").write_text(_task_yaml(f"astrai_tiny_{name}", data, body))
    return root


def _evaluate(model: str, export: Path, tasks: Path, **extra) -> dict:
    args = f"pretrained={export},dtype=float32,max_length={MAX_LENGTH}"
    return lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=["astrai_tiny_mc", "astrai_tiny_rolling", "astrai_tiny_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
        **extra,
    )


def _by_doc(result: dict, task: str) -> list[dict]:
    return sorted(result["samples"][task], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def runs(export, tasks) -> dict[str, dict]:
    return {
        "hf": _evaluate("hf", export, tasks, batch_size=1),
        "astrai": _evaluate("astrai", export, tasks, batch_size="auto"),
    }


@pytest.mark.slow
def test_multiple_choice_matches_hf(runs):
    hf, ours = (_by_doc(runs[k], "astrai_tiny_mc") for k in ("hf", "astrai"))
    assert len(hf) == len(ours) == len(MC_DOCS)
    for a, b in zip(hf, ours):
        assert len(a["resps"]) == len(b["resps"]) == len(MC_DOCS[a["doc_id"]]["choices"])
        for (ref,), (got,) in zip(a["resps"], b["resps"]):
            assert got[0] == pytest.approx(ref[0], abs=1e-4)
            assert got[1] == ref[1]  # is_greedy
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    hf_acc, our_acc = (runs[k]["results"]["astrai_tiny_mc"]["acc,none"] for k in ("hf", "astrai"))
    assert our_acc == hf_acc


@pytest.mark.slow
def test_rolling_loglikelihood_matches_hf(runs):
    hf, ours = (_by_doc(runs[k], "astrai_tiny_rolling") for k in ("hf", "astrai"))
    for a, b in zip(hf, ours):
        (ref,), (got,) = a["resps"], b["resps"]
        assert got == pytest.approx(ref, abs=1e-4, rel=1e-6)
    # The long text spans several windows: a wrong window would be far off, not 1e-4.
    assert len(hf) == 3


@pytest.mark.slow
def test_greedy_generation_matches_hf(runs):
    hf, ours = (_by_doc(runs[k], "astrai_tiny_gen") for k in ("hf", "astrai"))
    texts = [b["resps"][0][0] for b in ours]
    assert texts == [a["resps"][0][0] for a in hf]
    assert any(texts)  # something was generated (and cut at "e" or a newline)


@pytest.fixture(scope="module")
def lms(export) -> tuple[HFLM, AstraiLM]:
    kw = dict(pretrained=str(export), dtype="float32", device="cpu", max_length=MAX_LENGTH)
    return HFLM(batch_size=4, **kw), AstraiLM(batch_size=3, page_size=4, **kw)


@pytest.mark.slow
def test_token_requests_with_greedy_continuations_match_hf(lms, export):
    """Requests given as token ids, half of them continued by the model's own argmax (so
    `is_greedy` is True there), shared contexts across page boundaries, one left-truncated."""
    hf_lm, ours = lms
    model = AutoModel.from_pretrained(export).eval()
    g = torch.Generator().manual_seed(0)
    requests = []
    for n in (1, 3, 5, 9, 17, 40, 60):
        context = torch.randint(3, 300, (n,), generator=g).tolist()
        greedy, ids = [], list(context)
        for _ in range(3):
            with torch.no_grad():
                greedy.append(int(model(torch.tensor([ids[-MAX_LENGTH:]]))[0, -1].argmax()))
            ids.append(greedy[-1])
        other = torch.randint(3, 300, (2,), generator=g).tolist()
        requests += [(None, context, greedy), (None, context, other), (None, context, greedy[:1])]
    expected = hf_lm._loglikelihood_tokens(requests, disable_tqdm=True)
    got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [g for _, g in got] == [g for _, g in expected]
    assert sum(g for _, g in got) >= 12  # the argmax continuations (n=60 is truncated)
    for (lp, _), (ref, _) in zip(got, expected):
        assert lp == pytest.approx(ref, abs=1e-4)


@pytest.mark.slow
def test_contexts_beyond_the_kv_budget_still_share_the_prefix_cache(lms, export):
    """Ten questions whose contexts need more KV than the engine has: the calls are cut so
    that each question's context stays cached until its last choice (one call over all of
    them would evict every context, least recently used, just before its next choice)."""
    hf_lm, _ = lms
    ours = AstraiLM(
        pretrained=str(export),
        dtype="float32",
        device="cpu",
        max_length=MAX_LENGTH,
        page_size=4,
        kv_tokens=256,
    )
    g = torch.Generator().manual_seed(2)
    requests = []
    for _ in range(10):
        context = torch.randint(3, 300, (40,), generator=g).tolist()
        for _ in range(3):
            requests.append((None, context, torch.randint(3, 300, (2,), generator=g).tolist()))
    got = ours._loglikelihood_tokens(requests, disable_tqdm=True)
    # Two later choices of each of the ten questions reuse its context's 36 page-aligned
    # tokens (the last context token is always computed again).
    assert ours.engine.get_stats()["cached_prompt_tokens"] == 10 * 2 * 36
    expected = hf_lm._loglikelihood_tokens(requests, disable_tqdm=True)
    for (lp, greedy), (ref, ref_greedy) in zip(got, expected):
        assert lp == pytest.approx(ref, abs=1e-4) and greedy == ref_greedy


@pytest.mark.slow
def test_empty_context_and_string_requests_match_hf(lms):
    # No two requests here tokenize to the same sequence split differently: `hf`'s
    # one-token-continuation logits cache scores the shorter continuation of such a pair
    # against the wrong positions (lm-eval 0.4.13).
    hf_lm, ours = lms
    reqs = [
        Instance("loglikelihood", {}, ("", "the quick brown fox"), 0),
        Instance("loglikelihood", {}, ("the lazy ", "dog sleeps"), 1),
        Instance("loglikelihood", {}, (LONG, " sun"), 2),
    ]
    expected = hf_lm.loglikelihood(reqs, disable_tqdm=True)
    got = ours.loglikelihood(reqs, disable_tqdm=True)
    for (lp, greedy), (ref, ref_greedy) in zip(got, expected):
        assert lp == pytest.approx(ref, abs=1e-4) and greedy == ref_greedy


def test_bad_model_args_are_named_before_loading(tmp_path):
    with pytest.raises(ValueError, match="unknown option 'max_batchsize'"):
        AstraiLM(pretrained=str(tmp_path / "nowhere"), max_batchsize=4)
    with pytest.raises(ValueError, match="batch_size='many'"):
        AstraiLM(pretrained=str(tmp_path / "nowhere"), batch_size="many")
    with pytest.raises(ValueError, match="pretrained=<model directory> is required"):
        AstraiLM()
    with pytest.raises(ValueError, match="set max_length"):
        AstraiLM(pretrained=str(tmp_path), max_seq_len=64)


@pytest.mark.slow
def test_cli_wrapper_runs_lm_eval(export, tasks, runs, tmp_path):
    """`python -m astrai.eval.harness` is lm-eval's CLI with the `astrai` model registered."""
    out = tmp_path / "results"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.eval.harness",
            "--model",
            "astrai",
            "--model_args",
            f"pretrained={export},dtype=float32,max_length={MAX_LENGTH}",
            "--tasks",
            "astrai_tiny_mc",
            "--include_path",
            str(tasks),
            "--device",
            "cpu",
            "--batch_size",
            "auto",
            "--output_path",
            str(out),
        ],
        check=True,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=600,
    )
    (saved,) = out.rglob("results_*.json")
    acc = json.loads(saved.read_text())["results"]["astrai_tiny_mc"]["acc,none"]
    assert acc == runs["hf"]["results"]["astrai_tiny_mc"]["acc,none"]
