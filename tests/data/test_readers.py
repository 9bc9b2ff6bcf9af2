"""Parquet, arrow and `datasets` inputs of `prepare` (astrai.data.readers, wired through
astrai.data.inputs): the same records in every format prepare to byte-identical storages
(files written here with pyarrow and `datasets` themselves, the independent writers), a large
parquet file prepares with bounded memory, a changed parquet input is refused on resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import h5py
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from astrai.data import AstraiDataModule
from astrai.data.fingerprint import DataChangedError
from astrai.data.inputs import input_files, iter_input
from astrai.data.prepare import prepare
from astrai.data.storage import DataError

RECORDS = {
    "sft": [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"What is {i} + {i + 2}?"},
                {"role": "assistant", "content": f"{2 * i + 2}"},
            ]
        }
        for i in range(12)
    ],
    "preference": [
        {"prompt": f"Name {i}.", "chosen": f"It is {i}.", "rejected": f"No {i + 1}."}
        for i in range(10)
    ],
    "prompt": [{"prompt": f"Add {i} and {i}.", "answer": str(2 * i)} for i in range(10)],
    "unpaired": [
        {"prompt": f"Double {i}.", "completion": str(2 * i), "label": i % 3 != 0} for i in range(9)
    ],
    "pretrain": [{"text": f"def f{i}(x):\n    return x * {i}\n" * (i + 1)} for i in range(8)],
}


def _write_all(records: list[dict], folder: Path) -> dict[str, Path]:
    """The records as JSONL, parquet (two row groups), an arrow IPC file, an arrow IPC stream
    and a `datasets` folder."""
    folder.mkdir(parents=True)
    paths = {name: folder / name for name in ("a.jsonl", "a.parquet", "file.arrow", "s.arrow")}
    paths["a.jsonl"].write_text("".join(json.dumps(r) + "\n" for r in records))
    # one schema over all rows (pa.array infers struct fields from every record, nulls where
    # one lacks a field: what writers of the Hub's files do)
    table = pa.Table.from_struct_array(pa.array(records))
    pq.write_table(table, paths["a.parquet"], row_group_size=max(1, len(records) // 2))
    with ipc.new_file(paths["file.arrow"], table.schema) as writer:
        for batch in table.to_batches(max_chunksize=3):
            writer.write_batch(batch)
    with ipc.new_stream(paths["s.arrow"], table.schema) as writer:
        writer.write_table(table)
    paths["datasets"] = folder / "ds"
    datasets.Dataset(table).save_to_disk(str(paths["datasets"]), num_shards=2)
    return paths


def _storage(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every array and every attribute but the signature (which names the input files)."""
    with h5py.File(path, "r") as f:
        arrays: dict[str, np.ndarray] = {}
        f.visititems(
            lambda k, v: arrays.__setitem__(k, v[()]) if isinstance(v, h5py.Dataset) else None
        )
        attrs = {k: str(v) for k, v in f.attrs.items() if k != "signature"}
    return arrays, attrs


@pytest.mark.parametrize("kind", sorted(RECORDS))
def test_every_format_prepares_to_the_jsonl_storage(kind: str, tmp_path: Path, tok) -> None:
    paths = _write_all(RECORDS[kind], tmp_path / "in")
    outputs = {
        name: prepare(kind, path, tmp_path / "out" / name.replace(".", "_"), tok, name=kind)
        for name, path in paths.items()
    }
    want_arrays, want_attrs = _storage(outputs["a.jsonl"].path)
    assert want_arrays and outputs["a.jsonl"].documents > 0
    for name, result in outputs.items():
        arrays, attrs = _storage(result.path)
        assert attrs == want_attrs, name
        assert sorted(arrays) == sorted(want_arrays), name
        for key, value in want_arrays.items():
            assert arrays[key].dtype == value.dtype and np.array_equal(arrays[key], value), (
                name,
                key,
            )


def test_rows_are_named_by_file_and_row_and_a_null_is_an_absent_field(tmp_path: Path, tok) -> None:
    tool_call = {"type": "function", "function": {"name": "add", "arguments": "{}"}}
    with_tools = {
        "messages": [
            {"role": "user", "content": "1 + 1?"},
            {"role": "assistant", "content": "2", "tool_calls": [tool_call]},
        ]
    }
    records = [*RECORDS["sft"][:2], with_tools, {"conversation": ["hi"]}]
    paths = _write_all(records, tmp_path / "in")
    rows = list(iter_input(str(paths["a.parquet"]), "sft", {}))
    assert [w for w, _ in rows] == [f"{paths['a.parquet']}:row {i}" for i in range(1, 5)]
    # arrow's one schema gives the other rows' messages a null tool_calls: read as absent
    assert [r for _, r in rows] == records
    # rows are counted per file: the `datasets` folder's 4 rows are 2 shards of 2
    for name, where in (
        ("a.parquet", "a.parquet:row 4"),
        ("s.arrow", "s.arrow:row 4"),
        ("datasets", "00002.arrow:row 2"),
    ):
        with pytest.raises(
            DataError,
            match=rf"{where}: .*missing required field 'messages' \(has: \['conversation'\]\)",
        ):
            prepare("sft", paths[name], tmp_path / "out" / name, tok, name="bad")


def test_a_folder_reads_dataset_folders_in_place_and_refuses_a_dataset_dict(
    tmp_path: Path,
) -> None:
    paths = _write_all(RECORDS["sft"], tmp_path / "in")
    files = input_files(tmp_path / "in", "sft")
    shards = sorted((tmp_path / "in" / "ds").glob("*.arrow"))
    # every data file once, the `datasets` folder's metadata JSON not taken for records
    assert files == [
        paths["a.jsonl"],
        paths["a.parquet"],
        *shards,
        paths["file.arrow"],
        paths["s.arrow"],
    ]
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS["sft"])}).save_to_disk(
        str(dd)
    )
    with pytest.raises(DataError, match=r"a DatasetDict folder \(splits \['train'\]\).*dd/train"):
        input_files(dd, "sft")
    assert input_files(dd / "train", "sft") == sorted((dd / "train").glob("*.arrow"))
    broken = tmp_path / "in" / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable parquet file"):
        list(iter_input(str(broken), "sft", {}))


def test_a_changed_parquet_input_is_refused_on_resume(tmp_path: Path, tok_dir) -> None:
    source = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS["sft"]), source)
    spec = {"_target_": "astrai.data.SFTDataset", "source": str(source), "prepare": {}}
    dm = AstraiDataModule(train=spec, batch_size=2, seed=0)
    dm.connect(tok_dir, tmp_path / "cache")
    dm.setup("fit")
    state = dm.state_dict()
    pq.write_table(pa.Table.from_pylist(RECORDS["sft"][::-1]), source)
    again = AstraiDataModule(train=spec, batch_size=2, seed=0)
    again.connect(tok_dir, tmp_path / "cache")
    again.setup("fit")
    assert again.specs["train"]["source"] != dm.specs["train"]["source"]
    with pytest.raises(DataChangedError, match=r"data\.train"):
        again.load_state_dict(state)


# A child process measures its own peak RSS around prepare, so that nothing the test itself
# allocated counts (VmHWM: the high-water mark of the resident set, /proc/self/status). It
# first prepares a one-row-group file of the same rows, so that what any prepare costs once
# (lazy imports, the first buffers: some 30 MiB) is in the baseline, not the growth.
_MEASURE = textwrap.dedent(
    """
    import json, sys
    import pyarrow.parquet
    from astrai.data.prepare import prepare
    from astrai.tokenizer import AutoTokenizer

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

    tok = AutoTokenizer.from_pretrained(sys.argv[2])
    prepare("pretrain", sys.argv[4], sys.argv[3], tok, name="warm_up", progress=False)
    before = hwm()
    result = prepare("pretrain", sys.argv[1], sys.argv[3], tok, progress=False)
    print(json.dumps({"before": before, "after": hwm(), "records": result.records}))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_200mb_parquet_file_prepares_in_bounded_memory(tmp_path: Path, tok_dir) -> None:
    """200 MB of rows (a short text each, and 2 KB of incompressible bytes the records carry):
    the peak resident set grows by a small part of the file's size (about 15 MiB here; 243 MiB
    with pyarrow's default pre-buffering)."""
    path = tmp_path / "big.parquet"
    rows_per_group, groups = 8192, 12
    rng = np.random.default_rng(0)
    schema = pa.schema([("text", pa.string()), ("blob", pa.string())])
    with pq.ParquetWriter(path, schema, compression="none", use_dictionary=False) as writer:
        for g in range(groups):
            blobs = [rng.bytes(1024).hex() for _ in range(rows_per_group)]
            texts = [f"row {g * rows_per_group + i}" for i in range(rows_per_group)]
            writer.write_table(pa.table({"text": texts, "blob": blobs}, schema=schema))
    size = path.stat().st_size
    assert size > 190 * 2**20
    warm_up = tmp_path / "warm_up.parquet"
    pq.write_table(pq.ParquetFile(path).read_row_group(0), warm_up)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _MEASURE,
            str(path),
            str(tok_dir),
            str(tmp_path / "out"),
            str(warm_up),
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["records"] == rows_per_group * groups
    growth = m["after"] - m["before"]
    assert growth < size / 4, (
        f"peak RSS grew {growth / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
    )
