"""`astrai.extension.omp.release_idle_team`: the calling thread's idle OpenMP workers go,
so that the engine's loop thread gets a team that is not throttled (see the module)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

CHILD = textwrap.dedent(
    """
    import os, torch
    from astrai.extension.omp import release_idle_team

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    before = threads()
    for _ in range(3):
        x @ x  # a 2-thread parallel region: this thread's team now exists
    with_team = threads()
    released = release_idle_team()
    after = threads()
    for _ in range(3):
        x @ x  # the thread gets a team again when it needs one
    print(before, with_team, released, after, threads())
    """
)


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and torch.backends.openmp.is_available()),
    reason="libgomp's teams are observable through /proc on Linux only",
)
def test_the_idle_team_of_the_calling_thread_is_released():
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=120,
    ).stdout.split()
    before, with_team, released, after, again = (
        int(out[0]),
        int(out[1]),
        out[2],
        int(out[3]),
        int(out[4]),
    )
    if released != "True":
        pytest.skip("this torch does not use libgomp")
    assert with_team > before  # the worker that the 2-thread product started
    assert after == with_team - 1  # ... is gone once released
    assert again == with_team  # and comes back with the next parallel region


def test_release_is_harmless_without_a_team():
    from astrai.extension.omp import release_idle_team

    assert release_idle_team() in (True, False)
    assert torch.ones(3).sum().item() == 3.0  # torch still works afterwards
