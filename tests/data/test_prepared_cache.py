"""The prepared-data cache of training runs (astrai.data.cache): a damaged entry is prepared
again, since the cache is astrai's to rewrite."""

from __future__ import annotations

import logging
from pathlib import Path

from astrai.data.cache import prepared_source
from astrai.data.storage import H5Storage


def test_a_damaged_cache_entry_is_prepared_again(tmp_path: Path, tok, tok_dir, caplog) -> None:
    job = prepared_source(
        "prompt",
        "builtin:arithmetic/prompt",
        {"builtin": {"n": 12}, "progress": False},
        fingerprint=str(tok.fingerprint),
        data_dir=tmp_path,
        name="train",
    )
    first = job.run(tok_dir)
    path = Path(job.path)
    assert first.documents == 12 == len(H5Storage(path))
    path.write_bytes(path.read_bytes()[:1000])  # cut short (a full disk, a bad copy)
    with caplog.at_level(logging.WARNING, logger="astrai.data.cache"):
        again = job.run(tok_dir)
    assert f"prepared-data cache: {path} is damaged" in caplog.text
    assert "preparing it again" in caplog.text
    assert again.documents == 12 == len(H5Storage(path))
