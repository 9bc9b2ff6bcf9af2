"""Every `data=*_files` config (your own files) tokenizes its val files on first use exactly
as its train files: a val split given as text/JSONL is prepared, never opened as HDF5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.utils import instantiate

from astrai.data.builtin import (
    arithmetic_problems,
    preference_records,
    prompt_records,
    sft_records,
    stdlib_corpus,
)
from astrai.train.runner import CONF_DIR, compose

FILES_CONFIGS = sorted(p.stem for p in (CONF_DIR / "data").glob("*_files.yaml"))


def _write(path: Path, kind: str, seed: int) -> Path:
    problems = arithmetic_problems(24, seed=seed)
    if kind == "pretrain":
        path = path.with_suffix(".txt")
        path.write_text("\n\n".join(list(stdlib_corpus("train", max_files=3))), encoding="utf-8")
        return path
    if kind == "unpaired":  # each pair as two thumbs-up/down records
        records = [
            {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
            for r in preference_records(problems)
            for side in ("chosen", "rejected")
        ]
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        return path
    records = {
        "sft": sft_records,
        "preference": preference_records,
        "prompt": prompt_records,
    }[kind](problems)
    path = path.with_suffix(".jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_every_files_config_is_covered() -> None:
    assert {
        "pretrain_files",
        "sft_files",
        "preference_files",
        "unpaired_files",
        "prompt_files",
    } <= set(FILES_CONFIGS)


@pytest.mark.parametrize("name", FILES_CONFIGS)
def test_val_files_are_prepared_like_train(name: str, tmp_path: Path, tok_dir: Path) -> None:
    kind = name.removesuffix("_files")
    train = _write(tmp_path / "train", kind, seed=1)
    val = _write(tmp_path / "val", kind, seed=2)
    overrides = [f"data={name}", f"data.train.source={train}", "paths.output_dir=/tmp/unused"]
    has_val = compose([f"data={name}", "paths.output_dir=/tmp/unused"]).data.val is not None
    if has_val:
        overrides.append(f"data.val.source={val}")
    cfg = compose(overrides)
    if kind == "pretrain":  # windows that a few stdlib files fill
        cfg.data.train.window_size = cfg.data.val.window_size = 64
    dm = instantiate(cfg.data, _convert_="all", _recursive_=False)
    dm.connect(tok_dir, tmp_path / "cache")
    assert set(dm.prepared) == ({"train", "val"} if has_val else {"train"})
    dm.num_workers = 0
    dm.setup("fit")
    assert len(dm.datasets["train"]) > 0
    if has_val:
        assert len(dm.datasets["val"]) > 0
        assert str(dm.prepared["val"].path).startswith(str(tmp_path / "cache"))
