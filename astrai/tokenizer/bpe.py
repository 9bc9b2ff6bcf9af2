"""Training a byte-level BPE with the special tokens astrai's chat format uses."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from astrai.tokenizer.tokens import DEFAULT_ADDED_TOKENS, DEFAULT_SPECIAL_TOKENS

logger = logging.getLogger(__name__)

__all__ = ["train_bpe"]

_BYTE_ALPHABET_SIZE = 256


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    bos_token: str,
    eos_token: str,
    pad_token: str,
    min_frequency: int = 2,
    special_tokens: Sequence[str] | None = None,
    added_tokens: Sequence[str] | None = None,
    split_digits: bool = True,
    show_progress: bool = False,
) -> Tokenizer:
    """A byte-level BPE whose final vocabulary (added tokens included) has ``vocab_size``
    entries, or fewer when the corpus has too few merges.

    Every byte is in the initial alphabet, so any string is encodable (no UNK).
    ``special_tokens`` defaults to bos/eos/pad + ``<|im_start|>``/``<|im_end|>``;
    ``added_tokens`` (non-special, kept by ``decode(skip_special_tokens=True)``)
    defaults to the tool-call and think tags. ``split_digits`` gives every digit its own
    token (as Llama and Qwen do): numbers then share one representation per digit, which is
    what lets a small model learn arithmetic instead of memorising multi-digit merges.
    """
    specials = list(DEFAULT_SPECIAL_TOKENS if special_tokens is None else special_tokens)
    for token in (bos_token, eos_token, pad_token):
        if token not in specials:
            specials.insert(0, token)
    specials = list(dict.fromkeys(specials))
    extra = [
        t
        for t in (DEFAULT_ADDED_TOKENS if added_tokens is None else added_tokens)
        if t not in specials
    ]
    extra = list(dict.fromkeys(extra))
    minimum = _BYTE_ALPHABET_SIZE + len(specials) + len(extra)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the byte alphabet, {len(specials)} special "
            f"and {len(extra)} added tokens alone need {minimum}"
        )

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(extra),
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(_checked_texts(texts), trainer=trainer)
    if extra:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    # HF convention (Llama 3): encode(add_special_tokens=True) prepends bos, so
    # transformers and we agree on what "add special tokens" means.
    bos_id = tok.token_to_id(bos_token)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos_token} $A:0",
        pair=f"{bos_token} $A:0 {bos_token} $B:1",
        special_tokens=[(bos_token, bos_id)],
    )
    logger.info(
        "trained byte-level BPE: %d tokens (%d special, %d added)",
        tok.get_vocab_size(with_added_tokens=True),
        len(specials),
        len(extra),
    )
    return tok


def _checked_texts(texts: Iterable[str]) -> Iterator[str]:
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        yield text
