"""Data benchmark: preprocessing throughput and the memory cost of random access.

1. ``prepare`` throughput (tokenize + write HDF5) on real text, the stdlib corpus
   (``kind=pretrain``), and on arithmetic chats (``kind=sft``, chat template and loss mask);
   the same chats again from a JSONL file and from a parquet file (``sft_jsonl``,
   ``sft_parquet``: the reader's cost, since the rest of the work is equal).
2. A synthetic corpus of ``tokens`` random ids (documents of ``doc_min..doc_max`` tokens),
   written in chunks with :class:`~astrai.data.storage.H5Writer` into a temporary directory.
3. In a fresh process: open the corpus, then read ``reads`` random ``window_size`` windows
   through :class:`~astrai.data.PretrainDataset` and ``doc_reads`` random documents; the
   resident set size (``VmRSS``) is sampled throughout. The target is < 100 MB growth for a
   50M-token corpus: the storage must not load the corpus into memory.

``python -m astrai.bench data`` (options: ``conf/bench/data.yaml``, e.g. ``tokens=5000000``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import platform
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from astrai.data.builtin import builtin_records, stdlib_corpus
from astrai.data.datasets import PretrainDataset
from astrai.data.prepare import prepare
from astrai.data.storage import H5Storage, H5Writer, token_dtype
from astrai.tokenizer import AutoTokenizer

log = logging.getLogger(__name__)


def rss_mb() -> float:
    """Current resident set size in MB (``VmRSS``; ``ru_maxrss`` where /proc is absent)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------- prepare


def bench_prepare(cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cfg["tokenizer_path"]:
        tok = AutoTokenizer.from_pretrained(cfg["tokenizer_path"])
        out["tokenizer"] = cfg["tokenizer_path"]
    else:
        t0 = time.perf_counter()
        tok = AutoTokenizer.train(
            stdlib_corpus("train", max_bytes=2_000_000), cfg["tokenizer_vocab"]
        )
        out["tokenizer"] = f"byte-level BPE, vocab {tok.vocab_size}, trained on 2 MB of stdlib"
        out["tokenizer_train_s"] = time.perf_counter() - t0
    for kind, source, builtin in (
        ("pretrain", "builtin:stdlib/train", {"max_bytes": cfg["prepare_bytes"]}),
        ("sft", "builtin:arithmetic/sft", {"n": cfg["sft_records"], "seed": cfg["seed"]}),
    ):
        r = prepare(kind, source, work / "prepared", tok, builtin=builtin, overwrite=True)
        out[kind] = _throughput(r)
    for name, path in _chat_files(cfg, work).items():
        r = prepare("sft", path, work / "prepared", tok, name=name, overwrite=True)
        out[name] = _throughput(r)
    return out


def _throughput(r: Any) -> dict[str, Any]:
    return {
        "records": r.records,
        "documents": r.documents,
        "tokens": r.tokens,
        "seconds": r.seconds,
        "tokens_per_s": r.tokens / r.seconds,
    }


def _chat_files(cfg: dict[str, Any], work: Path) -> dict[str, Path]:
    """The arithmetic chats as a JSONL file and as a parquet file (pyarrow's defaults)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = list(builtin_records("arithmetic/sft", n=cfg["sft_records"], seed=cfg["seed"]))
    jsonl, parquet = work / "chats.jsonl", work / "chats.parquet"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_struct_array(pa.array(records)), parquet)
    return {"sft_jsonl": jsonl, "sft_parquet": parquet}


# ------------------------------------------------------------------------ synthetic corpus


def write_corpus(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """Random ids in documents of random length, generated and written chunk by chunk."""

    rng = np.random.default_rng(cfg["seed"])
    total, docs = int(cfg["tokens"]), 0
    dtype = token_dtype(cfg["vocab_size"])
    t0 = time.perf_counter()
    with (
        H5Writer(path, dtypes={"input_ids": dtype}, attrs={"kind": "pretrain"}) as writer,
        tqdm(total=total, unit="tok", unit_scale=True, desc="write corpus") as bar,
    ):
        written = 0
        while written < total:
            chunk = rng.integers(0, cfg["vocab_size"], size=min(1 << 20, total - written))
            chunk = chunk.astype(dtype)
            pos = 0
            while pos < len(chunk):
                n = int(rng.integers(cfg["doc_min"], cfg["doc_max"] + 1))
                writer.add(input_ids=chunk[pos : pos + n])
                pos += n
                docs += 1
            written += len(chunk)
            bar.update(len(chunk))
    seconds = time.perf_counter() - t0
    return {
        "tokens": total,
        "documents": docs,
        "dtype": str(dtype),
        "file_mb": path.stat().st_size / 2**20,
        "seconds": seconds,
        "tokens_per_s": total / seconds,
    }


# ---------------------------------------------------------------------------- random access


def index_job(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process, so that RSS reflects only opening and indexing the corpus."""
    rss_start = rss_mb()
    t0 = time.perf_counter()
    storage = H5Storage(path)
    ds = PretrainDataset(storage, window_size=cfg["window_size"])
    open_s = time.perf_counter() - t0
    ds[0]  # first access opens the HDF5 handle
    rss_before = rss_mb()
    rng = np.random.default_rng(cfg["seed"] + 1)
    samples: list[float] = []

    t0 = time.perf_counter()
    for i, index in enumerate(
        tqdm(rng.integers(0, len(ds), size=cfg["reads"]), desc="random windows", unit="win")
    ):
        item = ds[int(index)]
        assert item["input_ids"].shape[0] == cfg["window_size"]
        if i % 500 == 0:
            samples.append(rss_mb())
    window_s = time.perf_counter() - t0

    n_docs = len(storage)
    t0 = time.perf_counter()
    doc_tokens = 0
    for i, index in enumerate(
        tqdm(rng.integers(0, n_docs, size=cfg["doc_reads"]), desc="random documents", unit="doc")
    ):
        doc_tokens += len(storage.get("input_ids", int(index)))
        if i % 500 == 0:
            samples.append(rss_mb())
    doc_s = time.perf_counter() - t0
    rss_after = rss_mb()
    samples.append(rss_after)
    return {
        "windows": len(ds),
        "open_s": open_s,
        "rss_start_mb": rss_start,
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_after,
        "rss_max_sampled_mb": max(samples),
        "rss_growth_mb": max(samples) - rss_before,
        "rss_growth_from_start_mb": max(samples) - rss_start,
        "peak_rss_mb": peak_rss_mb(),
        "window_reads": cfg["reads"],
        "window_reads_per_s": cfg["reads"] / window_s,
        "window_tokens_per_s": cfg["reads"] * cfg["window_size"] / window_s,
        "doc_reads": cfg["doc_reads"],
        "doc_reads_per_s": cfg["doc_reads"] / doc_s,
        "doc_tokens_per_s": doc_tokens / doc_s,
    }


def _index_in_child(path: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    tqdm.set_lock(threading.RLock())  # no multiprocessing lock: nothing to leak at exit
    return index_job(path, cfg)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as fh:
            info["memory_gb"] = round(int(fh.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    import h5py

    info["h5py"] = h5py.__version__
    info["hdf5"] = h5py.version.hdf5_version
    return info


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """The whole benchmark with the options of conf/bench/data.yaml."""
    report: dict[str, Any] = {"config": cfg, "machine": machine()}
    with tempfile.TemporaryDirectory(dir=cfg["workdir"] or None, prefix="astrai-bench-") as tmp:
        work = Path(tmp)
        report["prepare"] = bench_prepare(cfg, work)
        corpus = work / "synthetic.h5"
        report["corpus"] = write_corpus(cfg, corpus)
        with mp.get_context("spawn").Pool(1) as pool:
            report["index"] = pool.apply(_index_in_child, (str(corpus), cfg))
    report["target_rss_growth_mb"] = 100
    report["target_met"] = report["index"]["rss_growth_from_start_mb"] < 100
    return report


def format_report(report: dict[str, Any]) -> str:
    p, c, ix = report["prepare"], report["corpus"], report["index"]
    lines = [
        f"tokenizer: {p['tokenizer']}",
        f"prepare pretrain (stdlib): {p['pretrain']['tokens']:,} tokens from "
        f"{p['pretrain']['documents']} files in {p['pretrain']['seconds']:.1f}s = "
        f"{p['pretrain']['tokens_per_s']:,.0f} tokens/s",
        f"prepare sft (arithmetic chats): {p['sft']['tokens']:,} tokens from "
        f"{p['sft']['documents']} records in {p['sft']['seconds']:.1f}s = "
        f"{p['sft']['tokens_per_s']:,.0f} tokens/s",
        *(
            f"prepare {name} (the same chats from a file): {p[name]['tokens']:,} tokens in "
            f"{p[name]['seconds']:.1f}s = {p[name]['tokens_per_s']:,.0f} tokens/s"
            for name in ("sft_jsonl", "sft_parquet")
        ),
        f"synthetic corpus: {c['tokens']:,} tokens ({c['dtype']}), {c['documents']:,} documents, "
        f"{c['file_mb']:.0f} MB, written at {c['tokens_per_s']:,.0f} tokens/s",
        f"open: {ix['open_s'] * 1e3:.1f} ms; {ix['windows']:,} windows of "
        f"{report['config']['window_size']}",
        f"random windows: {ix['window_reads']:,} reads, {ix['window_reads_per_s']:,.0f}/s "
        f"({ix['window_tokens_per_s']:,.0f} tokens/s)",
        f"random documents: {ix['doc_reads']:,} reads, {ix['doc_reads_per_s']:,.0f}/s "
        f"({ix['doc_tokens_per_s']:,.0f} tokens/s)",
        f"RSS: {ix['rss_start_mb']:.0f} MB after imports, {ix['rss_before_mb']:.0f} MB after "
        f"open, max {ix['rss_max_sampled_mb']:.0f} MB while indexing -> growth "
        f"{ix['rss_growth_mb']:.1f} MB since open, {ix['rss_growth_from_start_mb']:.1f} MB "
        f"since start (target < {report['target_rss_growth_mb']} MB: "
        f"{'met' if report['target_met'] else 'NOT met'})",
    ]
    return "\n".join(lines)
