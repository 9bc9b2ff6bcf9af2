"""prepare: every kind, the assistant-only loss mask, bad input, atomic output and resume."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_helpers import write_lines

import astrai.data.prepare as prep
from astrai.data.prepare import prepare
from astrai.data.shards import DamagedOutputError
from astrai.data.storage import DataError, H5Storage

ROOT = Path(__file__).resolve().parents[2]

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "12 + 30 = 42. The answer is 42."},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "The answer is 84."},
]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_sft_mask_covers_exactly_the_assistant_turns(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    result = prepare("sft", path, tmp_path / "out", tok, progress=False)
    assert (result.documents, result.records, result.num_skipped) == (1, 1, 0)
    st = H5Storage(tmp_path / "out" / "chat.h5")
    ids, mask = st.get("input_ids", 0).tolist(), st.get("loss_mask", 0).tolist()
    assert ids == tok.encode(tok.apply_chat_template(CHAT))  # the template's rendering
    runs = _runs(mask)
    answers = [m["content"] for m in CHAT if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    for (start, stop), answer in zip(runs, answers):
        assert tok.decode(ids[start:stop]) == answer + "<|im_end|>"
        assert tok.decode(ids[:start]).endswith("<|im_start|>assistant\n")  # header unmasked
    assert result.tokens == len(ids)


def test_pretrain_from_a_directory_of_text_and_jsonl(tmp_path: Path, tok) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("def f(x):\n    return x + 1\n")
    write_lines(src / "b.jsonl", [{"text": "import os"}, {"text": ""}, {"text": "print(1)"}])
    (src / ".hidden.txt").write_text("ignored")
    result = prepare("pretrain", src, tmp_path / "out", tok, progress=False)
    st = H5Storage(tmp_path / "out" / "src.h5", tokenizer_fingerprint=tok)
    texts = ["def f(x):\n    return x + 1\n", "import os", "print(1)"]
    assert len(st) == 3 and result.skipped == {"empty": 1}
    for i, text in enumerate(texts):
        assert st.get("input_ids", i).tolist() == [*tok.encode(text), tok.eos_token_id]
    assert result.tokens == st.num_tokens("input_ids")
    assert st.attrs["kind"] == "pretrain" and st.attrs["format_version"] == 1


def test_bad_json_line_names_file_and_line(tmp_path: Path, tok) -> None:
    path = write_lines(
        tmp_path / "chat.jsonl", [{"messages": CHAT}, "{not json", {"messages": CHAT[:3]}]
    )
    with pytest.raises(DataError, match=r"chat\.jsonl:2: not valid JSON"):
        prepare("sft", path, tmp_path / "out", tok, progress=False)
    assert not (tmp_path / "out" / "chat.h5").exists()
    assert not (tmp_path / "out" / "chat.h5.tmp").exists()
    result = prepare("sft", path, tmp_path / "out", tok, progress=False, skip_bad_lines=True)
    assert (result.documents, result.bad_lines) == (2, 1)
    assert "bad lines=1" in result.summary()


@pytest.mark.parametrize(
    ("kind", "record", "field"),
    [
        ("sft", {"conversation": []}, "messages"),
        ("preference", {"prompt": "q", "chosen": "a"}, "rejected"),
        ("prompt", {"prompt": "q"}, "answer"),
        ("pretrain", {"body": "x"}, "text"),
    ],
)
def test_missing_field_is_named(tmp_path: Path, tok, kind: str, record: dict, field: str) -> None:
    path = write_lines(tmp_path / "in.jsonl", [record])
    with pytest.raises(
        DataError, match=rf"in\.jsonl:1: record is missing required field '{field}'"
    ):
        prepare(kind, path, tmp_path / "out", tok, progress=False, required_fields=["answer"])


def test_bad_records_can_be_skipped_and_counted(tmp_path: Path, tok) -> None:
    path = write_lines(
        tmp_path / "c.jsonl",
        [{"messages": CHAT}, {"messages": [{"role": "wizard", "content": "x"}]}, {"x": 1}],
    )
    with pytest.raises(DataError, match=r"c\.jsonl:2: cannot render the chat.*wizard"):
        prepare("sft", path, tmp_path / "out", tok, progress=False)
    result = prepare("sft", path, tmp_path / "out", tok, progress=False, skip_bad_lines=True)
    assert result.documents == 1 and result.skipped == {"bad_record": 2}


def test_empty_input_is_an_error_and_writes_nothing(tmp_path: Path, tok) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: empty input"):
        prepare("sft", empty, tmp_path / "out", tok, progress=False)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match="no input files"):
        prepare("sft", tmp_path / "nothing", tmp_path / "out", tok, progress=False)
    with pytest.raises(DataError, match="all skipped"):
        prepare(
            "sft",
            write_lines(tmp_path / "x.jsonl", [{"messages": CHAT}]),
            tmp_path / "out",
            tok,
            progress=False,
            max_length=3,
        )
    assert [p.name for p in (tmp_path / "out").iterdir()] == []


def test_max_length_skips_or_truncates(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": CHAT[1:3]}])
    full = len(tok.encode(tok.apply_chat_template(CHAT)))
    r = prepare("sft", path, tmp_path / "a", tok, progress=False, max_length=full - 1)
    assert r.documents == 1 and r.skipped == {"too_long": 1}
    r = prepare(
        "sft", path, tmp_path / "b", tok, progress=False, max_length=full - 1, truncate=True
    )
    assert r.documents == 2
    assert len(H5Storage(tmp_path / "b" / "c.h5").get("input_ids", 0)) == full - 1


def test_packing_restarts_positions_per_document(tmp_path: Path, tok) -> None:
    records = [{"messages": CHAT[1:3]}, {"messages": CHAT[3:5]}, {"messages": CHAT}] * 3
    path = write_lines(tmp_path / "c.jsonl", records)
    plain = prepare("sft", path, tmp_path / "plain", tok, progress=False)
    packed = prepare(
        "sft", path, tmp_path / "packed", tok, progress=False, pack=True, window_size=96
    )
    a, b = H5Storage(tmp_path / "plain" / "c.h5"), H5Storage(tmp_path / "packed" / "c.h5")
    assert packed.documents == 9 and packed.windows == len(b) < len(a)
    assert np.concatenate([a.get("input_ids", i) for i in range(len(a))]).tolist() == (
        np.concatenate([b.get("input_ids", i) for i in range(len(b))]).tolist()
    )
    lengths = [len(a.get("input_ids", i)) for i in range(len(a))]
    pos = np.concatenate([b.get("position_ids", i) for i in range(len(b))])
    assert pos.tolist() == [p for n in lengths for p in range(n)]
    assert all(len(b.get("input_ids", i)) <= 96 for i in range(len(b)))
    assert plain.tokens == packed.tokens
    with pytest.raises(DataError, match="pack=true applies to kind=sft"):
        prepare("pretrain", path, tmp_path / "x", tok, pack=True, window_size=8)


class _Interrupt(BaseException):
    pass


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    real = prep.iter_input

    def iterate(*args, **kwargs):
        for i, item in enumerate(real(*args, **kwargs)):
            if i == n:
                raise _Interrupt
            yield item

    monkeypatch.setattr(prep, "iter_input", iterate)


def test_interrupted_sharded_run_resumes(tmp_path: Path, tok, monkeypatch) -> None:
    kwargs = {"progress": False, "shard_size": 10, "builtin": {"n": 45}}
    reference = prepare("sft", "builtin:arithmetic/sft", tmp_path / "ref", tok, **kwargs)
    assert reference.shards_written == 5

    _interrupt_after(monkeypatch, 25)
    with pytest.raises(_Interrupt):
        prepare("sft", "builtin:arithmetic/sft", tmp_path / "out", tok, **kwargs)
    monkeypatch.undo()
    assert not (tmp_path / "out" / "arithmetic-sft").exists()  # nothing visible yet
    partial = tmp_path / "out" / "arithmetic-sft.tmp"
    assert sorted(p.name for p in partial.iterdir()) == [
        "arithmetic-sft-00000.h5",
        "arithmetic-sft-00001.h5",
    ]
    (partial / "arithmetic-sft-00002.h5.tmp").write_bytes(b"half a file")  # a killed writer

    resumed = prepare("sft", "builtin:arithmetic/sft", tmp_path / "out", tok, **kwargs)
    assert (resumed.shards_reused, resumed.shards_written) == (2, 3)
    assert (resumed.documents, resumed.tokens) == (reference.documents, reference.tokens)
    a = H5Storage(tmp_path / "ref" / "arithmetic-sft")
    b = H5Storage(tmp_path / "out" / "arithmetic-sft")
    assert [a.get("input_ids", i).tolist() for i in range(len(a))] == [
        b.get("input_ids", i).tolist() for i in range(len(b))
    ]
    assert not partial.exists()


def test_interrupted_single_file_run_leaves_nothing(tmp_path: Path, tok, monkeypatch) -> None:
    _interrupt_after(monkeypatch, 5)
    with pytest.raises(_Interrupt):
        prepare("prompt", "builtin:arithmetic/prompt", tmp_path, tok, progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (tmp_path / "arithmetic-prompt.h5.tmp").write_bytes(b"stale")
    r = prepare(
        "prompt", "builtin:arithmetic/prompt", tmp_path, tok, progress=False, builtin={"n": 20}
    )
    assert r.documents == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arithmetic-prompt.h5"]


def test_rerun_is_a_no_op_and_other_options_need_overwrite(tmp_path: Path, tok) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"messages": CHAT}])
    first = prepare("sft", path, tmp_path / "out", tok, progress=False)
    mtime = os.stat(tmp_path / "out" / "c.h5").st_mtime_ns
    again = prepare("sft", path, tmp_path / "out", tok, progress=False)
    assert (again.shards_written, again.documents, again.tokens) == (0, 1, first.tokens)
    assert os.stat(tmp_path / "out" / "c.h5").st_mtime_ns == mtime
    cut = first.tokens - 2
    with pytest.raises(DataError, match="exists and was prepared from other input or options"):
        prepare("sft", path, tmp_path / "out", tok, progress=False, max_length=cut, truncate=True)
    assert os.stat(tmp_path / "out" / "c.h5").st_mtime_ns == mtime  # untouched
    r = prepare(
        "sft", path, tmp_path / "out", tok, progress=False, max_length=cut, truncate=True,
        overwrite=True,
    )  # fmt: skip
    assert r.tokens == cut == H5Storage(tmp_path / "out" / "c.h5").num_tokens("input_ids")


def test_prompt_records_keep_reward_fields(tmp_path: Path, tok) -> None:
    r = prepare(
        "prompt",
        "builtin:arithmetic/prompt",
        tmp_path,
        tok,
        progress=False,
        required_fields=["answer"],
        builtin={"n": 5, "seed": 3},
    )
    st = H5Storage(tmp_path / "arithmetic-prompt.h5")
    assert r.documents == 5 and st.string_keys == ["records"]
    assert '"answer"' in st.get("records", 0)


@pytest.mark.slow
def test_cli_runs_with_hydra(tmp_path: Path, tok_dir: Path) -> None:
    data = write_lines(tmp_path / "chat.jsonl", [{"messages": CHAT}, "oops", {"messages": CHAT}])
    cmd = [
        sys.executable, "-m", "astrai.data.prepare", "kind=sft", f"input={data}",
        f"output={tmp_path / 'out'}", f"tokenizer_path={tok_dir}", "skip_bad_lines=true",
        "progress=false", f"hydra.run.dir={tmp_path / 'hydra'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prepared sft: 2 documents" in proc.stdout and "bad lines=1" in proc.stdout
    assert len(H5Storage(tmp_path / "out" / "chat.h5")) == 2
    cmd[5] = f"input={tmp_path / 'missing.jsonl'}"
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1 and "input not found" in proc.stdout + proc.stderr


def test_a_cut_short_output_is_named_as_damaged(tmp_path: Path, tok) -> None:
    """Before: a truncated output was reported as "prepared from other input or options"."""
    path = write_lines(tmp_path / "c.jsonl", [{"messages": CHAT}] * 3)
    prepare("sft", path, tmp_path / "out", tok, progress=False)
    out = tmp_path / "out" / "c.h5"
    out.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
    with pytest.raises(DamagedOutputError) as err:
        prepare("sft", path, tmp_path / "out", tok, progress=False)
    message = str(err.value)
    assert message.startswith(f"{out} is damaged: {out}: damaged: cannot open as HDF5")
    assert message.endswith("pass overwrite=true to prepare it again")
    assert "other input or options" not in message
    again = prepare("sft", path, tmp_path / "out", tok, progress=False, overwrite=True)
    assert again.documents == 3 == len(H5Storage(out))


def test_a_damaged_shard_is_named_among_whole_ones(tmp_path: Path, tok) -> None:
    kwargs = {"progress": False, "shard_size": 10, "builtin": {"n": 30}}
    prepare("sft", "builtin:arithmetic/sft", tmp_path, tok, **kwargs)
    final = tmp_path / "arithmetic-sft"
    shard = final / "arithmetic-sft-00001.h5"
    shard.write_bytes(shard.read_bytes()[:2000])
    with pytest.raises(DamagedOutputError, match=rf"{final} is damaged: {shard}: damaged") as err:
        prepare("sft", "builtin:arithmetic/sft", tmp_path, tok, **kwargs)
    assert "00000" not in str(err.value) and "00002" not in str(err.value)


def test_every_shard_stores_the_checksum_of_its_data(tmp_path: Path, tok) -> None:
    """What `prepare` stores is the content digest the training run's fingerprint computes
    (and checks it against)."""
    import h5py

    from astrai.data.fingerprint import file_digest
    from astrai.data.storage.h5 import CHECKSUM_ATTR

    kwargs = {"progress": False, "shard_size": 10, "builtin": {"n": 25}}
    prepare("prompt", "builtin:arithmetic/prompt", tmp_path, tok, **kwargs)
    shards = sorted((tmp_path / "arithmetic-prompt").glob("*.h5"))
    assert len(shards) == 3
    for shard in shards:
        with h5py.File(shard, "r") as f:
            stored = f.attrs[CHECKSUM_ATTR]
        assert stored == file_digest(shard)
