"""`bench engine matrix=NAME` (astrai/bench/engine_matrix.py) and the prefill/decode and
prefix-overhead figures (engine_phases.py): fields and their consistency, never timings."""

import json

import pytest

from astrai.bench import engine_matrix
from astrai.bench.__main__ import main
from astrai.bench.engine_matrix import load_matrix, verdict
from astrai.model import preset

TINY = ["prompt_min=17", "prompt_max=40", "output_min=2", "output_max=6", "threads=1"]


@pytest.mark.slow
def test_tiny_matrix_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "matrix.json"
    report = main(["engine", "matrix=tiny", "hf_batch_sizes=[1,all]", *TINY, f"out={out}"])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    rows = saved["rows"]
    assert [r["id"] for r in rows] == ["tiny-d16-g2", "tiny-d32-g1-qk"]
    for row, spec in zip(rows, load_matrix("tiny")):
        model = dict(spec["model"])
        config = preset(model.pop("name"), **model)
        assert row["shape"] == {
            "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size,
            "layers": config.num_hidden_layers,
            "head_dim": config.head_dim,
            "gqa": config.num_attention_heads // config.num_key_value_heads,
            "qk_norm": config.qk_norm,
        }
        # Each path counts its tokens its own way: the scheduler's counter (async), the
        # results' ids (sync), the requested lengths (transformers); all must agree.
        tokens = row["async"]["tokens"]
        assert tokens == row["sync"]["tokens"] > row["requests"] == spec["requests"]
        assert {r["tokens"] for r in row["transformers"].values()} == {tokens}
        assert set(row["transformers"]) == {"bs=1", f"bs={row['requests']}"}
        hf = row["transformers"][row["hf_best"]]["tokens_per_s"]
        assert hf == max(r["tokens_per_s"] for r in row["transformers"].values())
        assert row["async_vs_hf"] == pytest.approx(row["async"]["tokens_per_s"] / hf)
        assert row["sync_vs_hf"] == pytest.approx(row["sync"]["tokens_per_s"] / hf)
        assert row["verdict"] == verdict(row["requests"], row["async_vs_hf"])
        phases = row["phases"]
        assert phases["prefill_tokens"] == row["sync"]["prompt_tokens"] > 0
        assert phases["prefill_tokens_per_s"] > 0 and phases["decode_tokens_per_s"] > 0
        assert phases["decode_tokens"] == tokens - row["requests"]
        over = row["prefix_overhead"]
        assert over["radix"]["tokens"] == over["no_cache"]["tokens"] == tokens
        assert over["radix_hit_rate"] == 0.0  # distinct prompts: nothing shared
        assert over["radix"]["prefix_indexed_tokens"] > 0  # ...but the radix tree was in use
        assert over["no_cache"]["prefix_indexed_tokens"] is None
        assert over["overhead"] == pytest.approx(
            over["no_cache"]["tokens_per_s"] / over["radix"]["tokens_per_s"] - 1
        )
    assert saved["misses"] == [r["id"] for r in rows if r["verdict"].startswith("MISS")]
    table = capsys.readouterr().out
    assert "| row | params | req | async tok/s | sync tok/s | hf best tok/s |" in table
    for row in rows:
        line = next(x for x in table.splitlines() if x.startswith(f"| {row['id']} |"))
        assert f"{row['async_vs_hf']:.2f}x" in line and line.endswith(f"| {row['verdict']} |")


def test_verdict_marks_the_rows_that_miss():
    assert verdict(48, 2.1) == "ok"
    assert verdict(32, 1.9) == "MISS (< 2.0x)"  # a target row (>= 16 requests) below 2x
    assert verdict(16, 1.9) == "MISS (< 2.0x)"  # issue #31: 16 requests are a target
    assert verdict(8, 1.9) == "ok (not a target)"
    assert verdict(8, 1.4) == "MISS (< 1.5x)"  # no row below 1.5x
    assert verdict(64, None) == "-"  # skip_hf=true


def test_cpu_matrix_covers_the_shapes_of_issue_18():
    configs = []
    for row in load_matrix("cpu"):
        model = dict(row["model"])
        configs.append(preset(model.pop("name"), **model))
    vocab = [c.vocab_size for c in configs]
    hidden = [c.hidden_size for c in configs]
    layers = [c.num_hidden_layers for c in configs]
    assert min(vocab) == 512 and max(vocab) >= 150_000
    assert (min(hidden), max(hidden)) == (256, 1024) and (min(layers), max(layers)) == (2, 12)
    assert {c.head_dim for c in configs} == {64, 128}
    assert {c.num_attention_heads // c.num_key_value_heads for c in configs} >= {1, 2, 4}
    assert {c.qk_norm for c in configs} == {True, False}
    assert sum(row["requests"] >= 32 for row in load_matrix("cpu")) >= 4


def test_cpu_matrix_has_the_small_qwen3_class_of_issue_31():
    """Several vocabularies, hidden sizes, layer counts and GQA ratios of the small Qwen3
    class (head_dim 64, q/k norm, GQA), with 16-48 requests each."""
    rows = [r for r in load_matrix("cpu") if r["id"].startswith("q3s-")]
    configs = []
    for row in rows:
        model = dict(row["model"])
        configs.append(preset(model.pop("name"), **model))
    assert all(c.head_dim == 64 and c.qk_norm for c in configs)
    assert all(c.num_key_value_heads < c.num_attention_heads for c in configs)  # GQA
    assert all(c.hidden_size < 1000 and c.num_hidden_layers <= 6 for c in configs)
    assert len({c.vocab_size for c in configs}) >= 4
    assert len({c.hidden_size for c in configs}) >= 4
    assert len({c.num_hidden_layers for c in configs}) >= 3
    assert len({c.num_attention_heads // c.num_key_value_heads for c in configs}) >= 3
    assert {r["requests"] for r in rows} >= {16, 48} and all(
        16 <= r["requests"] <= 48 for r in rows
    )


def test_matrix_options_are_refused_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="matrix='nope': unknown; available: cpu, tiny"):
        main(["engine", "matrix=nope"])
    with pytest.raises(SystemExit, match=r"matrix_rows: \['bogus'\] not in matrix 'tiny'"):
        main(["engine", "matrix=tiny", "matrix_rows=[bogus]"])
    assert [r["id"] for r in load_matrix("tiny", ["tiny-d32-g1-qk"])] == ["tiny-d32-g1-qk"]
    bad = tmp_path / "matrix.yaml"
    bad.write_text(
        "matrices:\n  m:\n    - {id: r, requests: 2, model: {name: tiny, num_key_value_heads: 3}}\n"
    )
    monkeypatch.setattr(engine_matrix, "MATRIX_FILE", bad)
    with pytest.raises(ValueError, match=r"row 'r'.*num_key_value_heads"):
        load_matrix("m")
    bad.write_text("matrices:\n  m:\n    - {id: r, requests: 2, modle: {name: tiny}}\n")
    with pytest.raises(ValueError, match="keys must be"):
        load_matrix("m")


def test_phases_and_table_of_a_report():
    from astrai.bench.engine_matrix import format_matrix
    from astrai.bench.engine_phases import phases

    sync = {"tokens": 40, "seconds": 3.0, "tokens_per_s": 40 / 3, "prompt_tokens": 100}
    sync |= {"prefill_seconds": 0.5, "decode_seconds": 2.0, "decode_tokens": 30}
    got = phases(sync)
    assert (got["prefill_tokens_per_s"], got["decode_tokens_per_s"]) == (200.0, 15.0)
    assert phases({**sync, "decode_seconds": 0.0})["decode_tokens_per_s"] is None
    row = {"id": "r1", "parameters": 2e6, "requests": 32, "phases": got, "verdict": "-"}
    row |= {"async": {"tokens_per_s": 10.0}, "sync": sync, "async_vs_sync": 0.75}
    report = {"matrix": "m", "device": "cpu", "threads": 1, "rows": [row], "misses": []}
    table = format_matrix(report)  # skip_hf=true and prefix_overhead=false: dashes
    assert "| r1 | 2.0M | 32 | 10.0 | 13.3 | - | - | - | 0.75x | 200 | 15.0 | - | - |" in table
    assert table.endswith("rows that miss: none")
