"""strategy=distill refuses bad settings at start-up, naming the key, before any model (student
or teacher) is built: lmbda / beta / temperature out of range, reverse_kl off-policy, a teacher
whose vocabulary is not the student's (read from its config.json and tokenizer only), an
offline (stored top-k) teacher with on-policy micro-batches; and a packed batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from astrai.model import ModelConfig, Transformer
from astrai.train.strategies.distill import DistillModule
from astrai.train.strategies.distill.live_teacher import check_teacher_vocab
from astrai.train.strategies.distill.sequences import dataset_sequences
from astrai.train.strategies.distill.stored_teacher import StoredTopKTeacher


@pytest.fixture(scope="module")
def student(tmp_path_factory, stdlib_tokenizer, save_model_dir):
    return save_model_dir(tmp_path_factory.mktemp("distill_opts") / "student", stdlib_tokenizer)


class MetaOnly:
    """A model factory that may be asked for shapes (device='meta') but never for weights."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, device=None, tokenizer=None) -> Transformer:
        assert str(device) == "meta", "the student was built before the settings were checked"
        cfg = ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
        with torch.device("meta"):
            return Transformer(cfg)


def _module(student, vocab: int, **options):
    return DistillModule(model=MetaOnly(vocab), tokenizer=str(student), **options)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"lmbda": -0.1}, "strategy.lmbda"),
        ({"lmbda": 1.5}, "strategy.lmbda"),
        ({"beta": 1.2}, "strategy.beta"),
        ({"temperature": 0.0}, "strategy.temperature"),
        ({"loss_type": "forward"}, "strategy.loss_type"),
        ({"loss_type": "reverse_kl", "lmbda": 0.5}, "strategy.lmbda=1"),
        ({"max_new_tokens": 0}, "strategy.max_new_tokens"),
        ({"teacher_model_init_kwargs": {"dtype": "int8"}}, "teacher_model_init_kwargs"),
    ],
)
def test_bad_options_refused_before_any_model(student, options, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _module(student, 384, teacher_model_name_or_path=str(student), **options)


def test_teacher_of_another_vocabulary_size_refused_before_its_weights(student, tmp_path):
    """A teacher directory with only a config.json (no weights: loading them would fail
    otherwise) of another vocabulary size: refused naming both sizes and the teacher's path."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    config = json.loads((student / "config.json").read_text())
    config["vocab_size"] = 512
    (teacher / "config.json").write_text(json.dumps(config))
    vocab = json.loads((student / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError) as err:
        _module(student, vocab, teacher_model_name_or_path=str(teacher))
    message = str(err.value)
    assert "vocab_size=512" in message and f"vocab_size={vocab}" in message
    assert str(teacher) in message and "strategy.teacher_model_name_or_path" in message


def test_teacher_with_another_tokenizer_refused(student, tmp_path):
    """Same size, two tokens' ids swapped in the teacher's tokenizer: refused naming both
    tokenizers (a silent id mismatch would distil the wrong tokens)."""
    teacher = tmp_path / "teacher"
    shutil.copytree(student, teacher)
    (teacher / "model.safetensors").unlink()  # never read: the check comes first
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    size = json.loads((student / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError, match="teacher's tokenizer") as err:
        check_teacher_vocab(teacher, size, student)
    assert str(teacher) in str(err.value) and str(student) in str(err.value)
    check_teacher_vocab(student, size, student)  # the same one passes


def test_stored_teacher_needs_lmbda_zero_and_gkd(student):
    vocab = json.loads((student / "config.json").read_text())["vocab_size"]
    with pytest.raises(ValueError, match=r"strategy\.lmbda=0\.5"):
        _module(student, vocab, lmbda=0.5)
    with pytest.raises(ValueError, match="loss_type"):
        _module(student, vocab, lmbda=1.0, loss_type="reverse_kl")
    module = DistillModule(
        model=MetaOnly(vocab)(device="meta").to_empty(device="cpu"),
        tokenizer=str(student),
        lmbda=0.0,
    )
    assert isinstance(module.teacher, StoredTopKTeacher)


def test_packed_batch_refused_naming_pack():
    ids = torch.arange(12).reshape(2, 6)
    batch = {
        "input_ids": ids,
        "labels": ids,
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]),
    }
    with pytest.raises(ValueError, match="pack=true"):
        dataset_sequences(batch, 0)
    batch["position_ids"] = torch.arange(6).repeat(2, 1)
    assert dataset_sequences(batch, 0).input_ids.shape == (2, 7)
