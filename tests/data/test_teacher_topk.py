"""prepare's teacher top-k (offline distillation): what it stores equals the teacher's own
``topk(log_softmax)`` at every target position, the file names k and the teacher, the SFT
dataset and collate hand it to the batch aligned with the labels, and a teacher of another
vocabulary (or a bad option) is refused before any weight is read."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from astrai.cli_keys import command_line
from astrai.data.datasets import SFTDataset
from astrai.data.onpolicy import policy_digest
from astrai.data.prepare import prepare
from astrai.data.storage import DataError, H5Storage
from astrai.data.teacher_topk import TOPK_IDS, TOPK_LOGPROBS, teacher_topk
from astrai.model import load_pretrained

ROOT = Path(__file__).resolve().parents[2]
K = 5
SFT = "builtin:arithmetic/sft/train"
BUILTIN = {"n": 9, "seed": 4}


@pytest.fixture(scope="module")
def teacher(tok, save_model_dir, tmp_path_factory) -> Path:
    """A random two-layer teacher on the data's tokenizer."""
    path = tmp_path_factory.mktemp("teacher") / "export"
    return save_model_dir(path, tok, seed=3, num_hidden_layers=2)


@pytest.fixture(scope="module")
def prepared(tok, teacher, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    kwargs = {"teacher_batch_size": 4, "teacher_chunk_size": 7}  # padding and head blocks
    prepare("sft", SFT, out, tok, builtin=BUILTIN, teacher=teacher, teacher_top_k=K,
            progress=False, **kwargs)  # fmt: skip
    return out / "arithmetic-sft-train.h5"


def _direct(model, ids: torch.Tensor) -> torch.Tensor:
    """The teacher's log-softmax after every prefix of one unpadded document."""
    with torch.no_grad():
        return torch.log_softmax(model(ids[None])[0, :-1].float(), dim=-1)


def test_stored_topk_is_the_teachers_own(prepared, teacher):
    storage = H5Storage(prepared)
    attrs = storage.attrs
    assert attrs["teacher_top_k"] == K
    named = json.loads(attrs["teacher"])
    assert named["path"] == str(teacher.resolve()) and named["digest"] == policy_digest(teacher)
    model = load_pretrained(teacher)
    for index in range(len(storage)):
        ids = torch.from_numpy(storage.get("input_ids", index))
        stored_ids = torch.from_numpy(storage.get(TOPK_IDS, index)).reshape(-1, K)
        stored_lp = torch.from_numpy(storage.get(TOPK_LOGPROBS, index)).reshape(-1, K)
        assert stored_lp.dtype == torch.float32 and len(stored_ids) == len(ids) - 1
        logp = _direct(model, ids)
        want_lp, want_ids = logp.topk(K, dim=-1)
        torch.testing.assert_close(stored_lp, want_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(logp.gather(-1, stored_ids), stored_lp, rtol=0, atol=1e-5)
        # the ids themselves wherever the ranking is not a near-tie
        gaps = torch.cat([want_lp, logp.topk(K + 1, dim=-1).values[:, -1:]], -1).diff(dim=-1)
        clear = (gaps.abs() > 1e-4).all(dim=-1)
        assert clear.float().mean() > 0.5
        assert torch.equal(stored_ids[clear], want_ids[clear])


def test_the_batch_carries_the_topk_aligned_with_labels(prepared, teacher):
    model = load_pretrained(teacher)
    data = SFTDataset(str(prepared), max_length=20)
    items = [data[i] for i in range(3)]
    for item in items:
        n = len(item["labels"])
        assert item[TOPK_IDS].shape == (n, K) == item[TOPK_LOGPROBS].shape
    batch = data.collate(items)
    b, s = batch["labels"].shape
    assert batch[TOPK_IDS].shape == (b, s, K) and batch[TOPK_IDS].dtype == torch.int64
    assert batch[TOPK_LOGPROBS].dtype == torch.float32
    for i, item in enumerate(items):
        n = len(item["labels"])
        full = torch.from_numpy(data.storage.get("input_ids", i))
        assert n == 20 < len(full) - 1  # cut by max_length
        want = _direct(model, full).topk(K, dim=-1).values[:n]  # after input_ids[:j + 1]
        torch.testing.assert_close(batch[TOPK_LOGPROBS][i, :n], want, rtol=0, atol=1e-5)
        assert not batch[TOPK_IDS][i, n:].any() and not batch[TOPK_LOGPROBS][i, n:].any()


def test_rerun_reuses_and_another_k_is_another_output(prepared, tok, teacher):
    out = prepared.parent
    again = prepare("sft", SFT, out, tok, builtin=BUILTIN, teacher=teacher, teacher_top_k=K,
                    teacher_batch_size=4, teacher_chunk_size=7, progress=False)  # fmt: skip
    assert again.shards_reused == 1
    with pytest.raises(DataError, match="prepared from other input or options"):
        prepare("sft", SFT, out, tok, builtin=BUILTIN, teacher=teacher, teacher_top_k=K + 1,
                progress=False)  # fmt: skip


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(
    tok, other_tok, save_model_dir, tmp_path
):
    other = save_model_dir(tmp_path / "other", other_tok)
    (other / "model.safetensors").write_bytes(b"not read")  # refused before the weights
    with pytest.raises(DataError) as err:
        prepare("sft", SFT, tmp_path / "out", tok, builtin=BUILTIN, teacher=other,
                teacher_top_k=K, progress=False)  # fmt: skip
    message = str(err.value)
    assert f"({other_tok.vocab_size} ids, fingerprint {str(other_tok.fingerprint)[:16]};" in message
    assert f"({tok.vocab_size} ids, fingerprint {str(tok.fingerprint)[:16]})" in message
    assert str(other) in message and not (tmp_path / "out").exists()
    # no tokenizer files: the sizes must agree
    bare = save_model_dir(tmp_path / "bare", tok)
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "vocab_size": tok.vocab_size + 64}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink(missing_ok=True)
    with pytest.raises(
        DataError, match=rf"no tokenizer files and a vocabulary of {tok.vocab_size + 64}"
    ):
        prepare("sft", SFT, tmp_path / "out", tok, builtin=BUILTIN, teacher=bare,
                teacher_top_k=K, progress=False)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"teacher_top_k": 4}, "teacher_top_k is set but teacher is not"),
        ({"teacher": "T", "teacher_top_k": 0}, "teacher_top_k must be an integer >= 1"),
        ({"teacher": "T"}, "teacher_top_k must be an integer >= 1"),
        ({"teacher": "T", "teacher_top_k": 10**6}, "exceeds the teacher's vocabulary"),
        ({"teacher": "T", "teacher_top_k": 4, "teacher_batch_size": 0}, "teacher_batch_size"),
        ({"teacher": "T", "teacher_top_k": 4, "teacher_dtype": "fp8"}, "teacher_dtype"),
        ({"teacher": "T", "teacher_top_k": 4, "pack": True, "window_size": 64}, "pack=true"),
        ({"teacher": "T", "teacher_top_k": 4, "kind": "prompt"}, "kind=sft only"),
        ({"teacher": "missing", "teacher_top_k": 4}, "not a model export directory"),
    ],
)
def test_bad_teacher_options_are_refused(kwargs, message, tok, teacher, tmp_path):
    kwargs = dict(kwargs)
    if kwargs.get("teacher") == "T":
        kwargs["teacher"] = teacher
    elif kwargs.get("teacher") == "missing":
        kwargs["teacher"] = tmp_path / "missing"
    kind = kwargs.pop("kind", "sft")
    source = "builtin:arithmetic/prompt/train" if kind == "prompt" else SFT
    with pytest.raises(DataError, match=message):
        prepare(kind, source, tmp_path / "out", tok, builtin=BUILTIN, progress=False, **kwargs)


def test_the_cli_keys_are_prepares_parameters():
    conf = OmegaConf.load(ROOT / "conf" / "prepare.yaml")
    keys = {k for k in conf if k not in ("hydra", "tokenizer_path")}
    params = set(inspect.signature(prepare).parameters)
    assert {k for k in keys if k.startswith("teacher")} == {
        "teacher", "teacher_top_k", "teacher_batch_size", "teacher_chunk_size",
        "teacher_device", "teacher_dtype",
    }  # fmt: skip
    assert keys <= params | {"kind", "input", "output"}
    command_line("prepare", ["kind=sft", "input=x", "output=y", "tokenizer_path=t",
                             "teacher=e", "teacher_top_k=8"])  # fmt: skip


def test_teacher_topk_of_documents_of_one_token_or_many():
    """A document of T tokens has T - 1 rows; the chunking over positions changes nothing."""
    torch.manual_seed(0)
    from astrai.model import ModelConfig, Transformer

    model = Transformer(ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2)).eval()  # fmt: skip
    docs = [[3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13]]
    one = teacher_topk(model, docs, 3, chunk_size=1)
    many = teacher_topk(model, docs, 3, chunk_size=100)
    assert [len(ids) for ids, _ in one] == [5, 1, 2]
    for (a_ids, a_lp), (b_ids, b_lp) in zip(one, many):
        assert (a_ids == b_ids).all() and abs(a_lp - b_lp).max() < 1e-6


def test_the_teacher_scored_on_its_own_stored_topk_has_no_divergence(prepared, teacher):
    """prepare -> dataset -> collate -> StoredTopKTeacher: the teacher as the student has a
    divergence of ~0 at every labelled position (a random student does not)."""
    from astrai.train.strategies.distill.stored_teacher import StoredTopKTeacher
    from astrai.train.strategies.distill.teacher import DistillLoss

    data = SFTDataset(str(prepared))
    batch = data.collate([data[i] for i in range(4)])
    with torch.no_grad():
        logits = load_pretrained(teacher)(
            batch["input_ids"], attention_mask=batch["attention_mask"]
        )
    scores = StoredTopKTeacher().score(batch["input_ids"], batch)  # grid [B, S - 1]
    width = batch["input_ids"].shape[1] - 1
    keep = (batch["labels"][:, :width] != -100).flatten().nonzero().flatten()
    student = logits[:, :width].reshape(-1, logits.shape[-1])[keep]
    targets = batch["labels"][:, :width].flatten()[keep]
    for beta in (0.0, 0.5, 1.0):
        own = scores.divergence(keep, student, targets, DistillLoss(beta=beta))
        assert own.abs().max() < 1e-5
        other = scores.divergence(keep, torch.randn_like(student), targets, DistillLoss(beta=beta))
        assert (other > 0).all() and other.mean() > 1e-3  # a near-uniform random teacher


def test_a_training_runs_cache_prepares_the_teacher_topk_once_per_teacher(
    tok, tok_dir, teacher, save_model_dir, tmp_path
):
    """A spec's ``prepare:`` block takes the teacher keys; the cache folder changes when the
    teacher's files are written again (same path), so a stale top-k is never reused."""
    import shutil

    from astrai.data.cache import prepared_source

    mine = tmp_path / "teacher"
    shutil.copytree(teacher, mine)
    options = {"builtin": {"n": 4}, "teacher": str(mine), "teacher_top_k": 3, "progress": False}

    def job():
        return prepared_source("sft", SFT, options, fingerprint=str(tok.fingerprint),
                               data_dir=tmp_path, name="train")  # fmt: skip

    first = job()
    first.run(tok_dir)
    assert H5Storage(first.path).attrs["teacher_top_k"] == 3
    assert job().folder == first.folder
    save_model_dir(mine, tok, seed=11, num_hidden_layers=2)  # retrained in place
    second = job()
    assert second.folder != first.folder
    second.run(tok_dir)
    a, b = H5Storage(first.path), H5Storage(second.path)
    assert json.loads(a.attrs["teacher"])["digest"] != json.loads(b.attrs["teacher"])["digest"]
    assert not (a.get(TOPK_LOGPROBS, 0) == b.get(TOPK_LOGPROBS, 0)).all()
