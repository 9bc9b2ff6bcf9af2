"""Export link refresh and the throughput token count (in-process)."""

from __future__ import annotations

from pathlib import Path

import torch

from astrai.train.callbacks import _rows, _tokens, refresh_link, throughput_monitor


def test_refresh_link_repoints_atomically(tmp_path: Path) -> None:
    a, b = tmp_path / "run_a", tmp_path / "run_b"
    (a / "export").mkdir(parents=True)
    (b / "export").mkdir(parents=True)
    link = tmp_path / "outputs" / "latest"
    refresh_link(link, a)
    assert link.resolve() == a.resolve() and (link / "export").is_dir()
    refresh_link(link, b)
    assert link.resolve() == b.resolve()
    assert not list(link.parent.glob(".latest.tmp*"))


def test_throughput_counts_real_tokens_of_the_batch() -> None:
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[0, 6:] = 0
    batch = {"input_ids": torch.zeros(4, 10, dtype=torch.long), "attention_mask": mask}
    assert _rows(batch) == 4
    assert _tokens(batch) == 36  # padding excluded; more than the rows (Throughput checks it)
    pref = {
        "chosen_input_ids": torch.zeros(2, 5),
        "chosen_attention_mask": torch.ones(2, 5),
        "rejected_attention_mask": torch.ones(2, 5),
    }
    assert _rows(pref) == 2 and _tokens(pref) == 20
    monitor = throughput_monitor(window_size=2)
    assert monitor.length_fn(batch) == 36
