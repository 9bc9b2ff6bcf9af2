"""Run generated Python programs so that a bad one costs a failed test, never the evaluation.

Each program runs in its own ``python -I`` subprocess (isolated mode: no user site, no
``PYTHON*`` variables), in a fresh temporary directory as its working directory, with an
environment built from nothing (``PATH``, locale, ``HOME``/``TMPDIR`` pointing at that
directory: no variable of the evaluating process, hence none of its secrets), stdin closed,
and limits: address space (``RLIMIT_AS``, so an unbounded allocation ends in MemoryError),
CPU seconds (``RLIMIT_CPU``), file size (``RLIMIT_FSIZE``, which also bounds its output) and
no core dumps, plus a wall-clock timeout after which its whole process group is killed.
Output is kept up to ``max_output`` bytes per stream.

The limits are set by a two-line launcher that then ``exec``s the interpreter on the program
(limits survive ``exec``), rather than in a ``preexec_fn``: programs are run from a thread
pool, and ``subprocess`` documents ``preexec_fn`` as unsafe when threads exist.

This contains accidents (infinite loops, memory blow-ups, stray files, leaked credentials in
the environment); it is not a security boundary against deliberately hostile code, which
runs as the same user and can read what that user can (use a container or VM for that).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from astrai.eval.suite import progress_bar

__all__ = ["ExecutionResult", "run_program", "run_programs", "sandbox_env"]

# Runs in the child before the program: apply the limits, then become the program.
_LAUNCHER = """\
import os, resource, sys
for name, value in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE"), sys.argv[1:5]):
    value, which = int(value), getattr(resource, name)
    if value >= 0:
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value if name != "RLIMIT_CPU" else hard))
os.execv(sys.executable, [sys.executable, "-I", sys.argv[5]])
"""


@dataclass(frozen=True)
class ExecutionResult:
    """How one program ended: ``passed`` (exit 0), ``failed`` (non-zero exit), ``timeout``
    (wall clock or CPU limit), ``memory`` (MemoryError under the address-space limit) or
    ``killed`` (another signal); output truncated to the sandbox's ``max_output``."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def sandbox_env(workdir: str) -> dict[str, str]:
    """The whole environment a program gets: nothing inherited from this process."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
    }


def _read(path: Path, limit: int) -> str:
    with path.open("rb") as fh:
        data = fh.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + "\n... [truncated]" if len(data) > limit else text


def _status(returncode: int | None, timed_out: bool, stderr: str) -> str:
    if timed_out or returncode == -signal.SIGXCPU:
        return "timeout"
    if returncode == 0:
        return "passed"
    if "MemoryError" in stderr:
        return "memory"
    return "killed" if returncode is not None and returncode < 0 else "failed"


def run_program(
    code: str,
    *,
    timeout: float = 10.0,
    memory_mb: int = 1024,
    cpu_seconds: int | None = None,
    max_output: int = 4096,
    max_file_mb: int = 16,
) -> ExecutionResult:
    """Run `code` as a Python program under the sandbox's limits; never raises for what the
    program does. `cpu_seconds` None: the timeout rounded up, plus one."""
    if timeout <= 0 or memory_mb <= 0 or max_output < 0:
        raise ValueError("run_program: timeout and memory_mb must be > 0, max_output >= 0")
    cpu = math.ceil(timeout) + 1 if cpu_seconds is None else int(cpu_seconds)
    limits = [memory_mb << 20, cpu, max_file_mb << 20, 0]
    with tempfile.TemporaryDirectory(prefix="astrai-sandbox-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        (work / "program.py").write_text(code, encoding="utf-8")
        out_path, err_path = work / ".stdout", work / ".stderr"
        started = time.perf_counter()
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _LAUNCHER, *map(str, limits), "program.py"],
                cwd=tmp,
                env=sandbox_env(tmp),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: killed as a whole
                close_fds=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)  # also what it left running in the background
                proc.wait()
        seconds = time.perf_counter() - started
        stdout, stderr = _read(out_path, max_output), _read(err_path, max_output)
    status = _status(proc.returncode, timed_out, stderr)
    return ExecutionResult(status, proc.returncode, stdout, stderr, seconds)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_programs(
    programs: Sequence[str], *, workers: int = 4, progress: bool = False, **limits: float
) -> list[ExecutionResult]:
    """`run_program` for every program, `workers` at a time; results in input order."""
    results: list[ExecutionResult | None] = [None] * len(programs)
    with (
        ThreadPoolExecutor(max_workers=max(1, int(workers))) as pool,
        progress_bar(len(programs), "execute", progress, "program") as bar,
    ):
        futures = {pool.submit(run_program, code, **limits): i for i, code in enumerate(programs)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            bar.update(1)
    return [r for r in results if r is not None]
