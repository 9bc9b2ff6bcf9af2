"""`python -m astrai.train.unigram [overrides] [--out FILE]`: the unigram baseline of a
training config, the floor its trained model must beat.

The tokenizer and the prepared train/val data are built (and cached) exactly as a run builds
them; the figures are `astrai.train.metrics.unigram_baseline`'s (add-one-smoothed token
frequencies of the training split, scored on the validation targets).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from astrai.tokenizer import AutoTokenizer
from astrai.tokenizer.bytes import token_byte_lengths
from astrai.train.metrics import dataset_targets, unigram_baseline

__all__ = ["main", "unigram_from_config"]


def unigram_from_config(overrides: list[str]) -> dict[str, Any]:
    """The unigram baseline of a training config (``experiment=tiny_pretrain`` ...): its
    tokenizer and prepared train/val data, built (and cached) exactly as a run builds them."""
    from hydra.utils import instantiate

    from astrai.train.runner import check_inputs, compose
    from astrai.train.tokenizer_setup import prepare_tokenizer

    cfg = compose([*overrides, "paths.output_dir=unused"])
    check_inputs(cfg)
    data_dir = cfg.paths.data_dir
    tokenizer_dir = prepare_tokenizer(cfg.tokenizer, data_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    datamodule = instantiate(cfg.data, _convert_="all", _recursive_=False)
    datamodule.connect(tokenizer_dir, data_dir)
    datamodule.setup()
    splits = {s: datamodule.datasets.get(s) for s in ("train", "val")}
    missing = [s for s, ds in splits.items() if ds is None]
    if missing:
        raise ValueError(f"data.{missing[0]}: the unigram baseline needs a {missing[0]} split")
    result = unigram_baseline(
        dataset_targets(splits["train"]),
        dataset_targets(splits["val"]),
        token_byte_lengths(tokenizer),
    )
    return {"name": str(cfg.name), "tokenizer": str(tokenizer_dir), **result}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m astrai.train.unigram",
        description="The add-one unigram baseline (nats/token, ppl, bpb) of a training "
        "config's validation data, e.g. +experiment=tiny_pretrain.",
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, as for python -m astrai.train"
    )
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    result = unigram_from_config(list(args.overrides))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
