"""Perplexity, bits per byte and the unigram baseline (astrai.train.metrics), against hand
computations and plain-Python references."""

from __future__ import annotations

import functools
import json
import math
import random
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from train_helpers import SMALL, TINY_MODEL

from astrai.data.datasets import IGNORE_INDEX
from astrai.model import preset_model
from astrai.tokenizer import AutoTokenizer
from astrai.tokenizer.bytes import corpus_metrics, token_byte_lengths
from astrai.train import unigram
from astrai.train.metrics import CorpusNLL, dataset_targets, unigram_baseline
from astrai.train.optim import adamw, constant
from astrai.train.strategies.pretrain import PretrainModule

TEXTS = [
    "def add(a, b):\n    return a + b  # 12 + 30 = 42\n",
    "héllo wörld, ünïcödé façade naïve café\n",
    "世界 你好 🚀🎉 Ελληνικά кириллица <tool_call>{}</tool_call>\n",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE small enough for the tiny model; multi-byte characters stay split
    into partial-UTF-8 tokens (too rare for merges)."""
    corpus = [t * 3 for t in TEXTS[:2]] * 20
    tok = AutoTokenizer.train(corpus, 320)
    out = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(out)
    return out


def test_corpus_nll_matches_a_hand_computation() -> None:
    """Two batches of different sizes; bpb = total nats / (ln 2 * total bytes), by hand."""
    lengths = torch.tensor([1, 2, 3, 0])  # bytes of tokens 0..3 (3: a special token)
    tally = CorpusNLL(lengths)
    # batch 1: uniform over 4 tokens, targets 1 and 3 -> 2 * ln 4 nats, 2 + 0 bytes
    tally.update(torch.zeros(1, 2, 4), torch.tensor([[1, 3]]))
    # batch 2: logits (ln 1, ln 2, ln 1, ln 4) -> p = (1/8, 2/8, 1/8, 4/8); target 2 (3 bytes),
    # one ignored position
    row = torch.log(torch.tensor([1.0, 2.0, 1.0, 4.0]))
    tally.update(torch.stack([row, row])[None], torch.tensor([[2, IGNORE_INDEX]]))
    nats = 2 * math.log(4) + math.log(8)
    assert tally.totals().tolist() == pytest.approx([nats, 3, 5])
    out = corpus_metrics(*tally.totals().tolist())
    assert out["bpb"] == pytest.approx(nats / (math.log(2) * 5))  # = 7 bits / 5 bytes
    assert out["bpb"] == pytest.approx(7 / 5)
    assert out["ppl"] == pytest.approx(math.exp(nats / 3))
    tally.reset()
    assert tally.totals().tolist() == [0, 0, 0]


def test_byte_table_counts_utf8_bytes_of_any_text(tokenizer_dir: Path) -> None:
    """Summed over a text's tokens, the table gives its UTF-8 length, also where tokens are
    partial characters (decode() would give U+FFFD, 3 bytes each); specials count 0."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    table = token_byte_lengths(tok, size=512)
    assert table.shape == (512,) and int(table[tok.vocab_size :].sum()) == 0
    partial = 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert int(table[ids].sum()) == len(text.encode("utf-8")), text
        partial += sum("\ufffd" in tok.decode([i]) for i in ids)
    assert partial > 0  # the case the byte-level alphabet is needed for is exercised
    for i in tok.special_ids:
        assert table[i] == 0
    tool = tok.token_to_id("<tool_call>")
    assert tool not in tok.special_ids and table[tool] == len("<tool_call>")


def test_unigram_baseline_by_hand() -> None:
    # train counts (2, 1, 1, 0) over V = 4 -> add-one p = (3, 2, 2, 1) / 8
    lengths = torch.tensor([1, 2, 3, 4])
    out = unigram_baseline(
        [torch.tensor([0, 0, 1]), torch.tensor([2])], [torch.tensor([0, 1, 3])], lengths
    )
    nats = -(math.log(3 / 8) + math.log(2 / 8) + math.log(1 / 8))
    assert out["nats"] == pytest.approx(nats)
    assert out["tokens"] == 3 and out["bytes"] == 1 + 2 + 4 and out["train_tokens"] == 4
    assert out["ppl"] == pytest.approx(math.exp(nats / 3))
    assert out["bpb"] == pytest.approx(nats / (math.log(2) * 7))


def test_unigram_baseline_against_plain_python() -> None:
    rng = random.Random(0)
    vocab = 50
    lengths = [rng.randint(0, 4) for _ in range(vocab)]
    train = [
        [min(int(rng.expovariate(0.2)), vocab - 1) for _ in range(rng.randint(1, 40))]
        for _ in range(30)
    ]
    val = [
        [min(int(rng.expovariate(0.2)), vocab - 1) for _ in range(rng.randint(1, 40))]
        for _ in range(10)
    ]
    counts = Counter(t for seq in train for t in seq)
    total = sum(counts.values())
    nats = -sum(math.log((counts[t] + 1) / (total + vocab)) for seq in val for t in seq)
    n = sum(len(s) for s in val)
    num_bytes = sum(lengths[t] for s in val for t in s)
    out = unigram_baseline(map(torch.tensor, train), map(torch.tensor, val), torch.tensor(lengths))
    assert out["nats"] == pytest.approx(nats, rel=1e-12)
    assert out["nats_per_token"] == pytest.approx(nats / n, rel=1e-12)
    assert out["bpb"] == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-12)


def test_dataset_targets_skip_ignored_labels() -> None:
    data = [
        {"labels": torch.tensor([IGNORE_INDEX, 4, 5])},
        {"labels": torch.tensor([6, IGNORE_INDEX])},
    ]
    assert [t.tolist() for t in dataset_targets(data)] == [[4, 5], [6]]


def _item(tok: AutoTokenizer, text: str) -> tuple[list[int], list[int]]:
    ids = tok.encode(text)
    return [tok.bos_token_id, *ids], [*ids, tok.eos_token_id]  # labels: the text, then eos


def test_pretrain_validation_logs_corpus_level_ppl_and_bpb(tokenizer_dir: Path) -> None:
    """Lightning validation over two unequal batches logs val/ppl and val/bpb of the whole
    set (a mean of batch means would differ), from plain cross entropy even with label
    smoothing; bytes are the texts' UTF-8 length (bos / eos / padding count none)."""
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    module = PretrainModule(
        model=functools.partial(preset_model, name="tiny"),
        optimizer=functools.partial(adamw, lr=1e-3),
        scheduler=constant,
        tokenizer=str(tokenizer_dir),
        label_smoothing=0.1,
    )
    items = [_item(tok, t) for t in TEXTS]
    nats = 0.0
    with torch.no_grad():
        module.eval()
        for inputs, labels in items:
            logp = torch.log_softmax(module.model(torch.tensor([inputs]))[0].float(), -1)
            nats -= float(logp[torch.arange(len(labels)), torch.tensor(labels)].sum())
    tokens = sum(len(labels) for _, labels in items)
    num_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)

    def batch(group: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(i) for i, _ in group)
        pad = lambda xs, v: [x + [v] * (width - len(x)) for x in xs]  # noqa: E731
        return {
            "input_ids": torch.tensor(pad([i for i, _ in group], tok.pad_token_id)),
            "labels": torch.tensor(pad([lab for _, lab in group], IGNORE_INDEX)),
        }

    loader = DataLoader([batch(items[:2]), batch(items[2:])], batch_size=None)
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    (result,) = trainer.validate(module, dataloaders=loader, verbose=False)
    assert result["val/bpb"] == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-5)
    assert result["val/ppl"] == pytest.approx(math.exp(nats / tokens), rel=1e-5)
    # a second validation starts from zero again
    (again,) = trainer.validate(module, dataloaders=loader, verbose=False)
    assert again["val/bpb"] == pytest.approx(result["val/bpb"], rel=1e-6)


def test_tally_is_idle_outside_validation(tokenizer_dir: Path) -> None:
    module = PretrainModule(
        model=functools.partial(preset_model, name="tiny"), tokenizer=str(tokenizer_dir)
    )
    ids = torch.randint(0, 300, (2, 8))
    module.compute_loss({"input_ids": ids, "labels": ids})
    assert module.val_nll is None


@pytest.mark.slow
def test_unigram_cli_on_tiny_data(tmp_path: Path, data_dir: Path, capsys) -> None:
    """`python -m astrai.train.unigram OVERRIDES` on the tiny_pretrain data (small
    settings): the figures of a plain-Python count over the same prepared windows."""
    overrides = [*SMALL, *TINY_MODEL, f"paths.data_dir={data_dir}"]
    out = tmp_path / "unigram.json"
    unigram.main(["+experiment=tiny_pretrain", *overrides, "--out", str(out)])
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result

    from hydra.utils import instantiate

    from astrai.train.runner import compose
    from astrai.train.tokenizer_setup import prepare_tokenizer

    cfg = compose([*overrides, "paths.output_dir=unused"])
    tok_dir = prepare_tokenizer(cfg.tokenizer, data_dir)
    dm = instantiate(cfg.data, _convert_="all", _recursive_=False)
    dm.connect(tok_dir, data_dir)
    dm.setup()
    train, val = dm.datasets["train"], dm.datasets["val"]
    counts = Counter(t for i in range(len(train)) for t in train[i]["labels"].tolist())
    targets = [t for i in range(len(val)) for t in val[i]["labels"].tolist()]
    vocab = AutoTokenizer.from_pretrained(tok_dir).vocab_size
    total = sum(counts.values())
    nats = -sum(math.log((counts[t] + 1) / (total + vocab)) for t in targets)
    assert result["tokens"] == len(targets) == len(val) * 128
    assert result["nats"] == pytest.approx(nats, rel=1e-9)
    assert result["ppl"] == pytest.approx(math.exp(nats / len(targets)), rel=1e-9)
    # stdlib sources are nearly all ASCII: about one byte per character of the decoded text
    text = AutoTokenizer.from_pretrained(tok_dir).decode(targets, skip_special_tokens=True)
    assert result["bytes"] == pytest.approx(len(text.encode("utf-8")), rel=1e-3)
    assert 1.0 < result["bpb"] < 8.0
