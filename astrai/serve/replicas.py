"""``python -m astrai.serve replicas=N [router=vllm]``: N server processes, one address.

Data parallelism the way vLLM's and SGLang's deployments do it: N independent
``python -m astrai.serve`` processes (the standard library's `subprocess`, nothing more),
each with the same overrides, and an existing router in front (`router=vllm`: the
`vllm-router` package, cache-aware; docs/serving.md, "Data-parallel serving").

Ports: without a router the replicas listen on ``port, port+1, ..., port+N-1``; with one the
router takes ``port`` (the one address clients use) and the replicas ``port+1 ... port+N``.
The aggregated `/metrics` (astrai.serve.metrics_aggregate) is on `metrics_port` (null: the
port after the last replica), the router's own Prometheus metrics on the one after that.

Devices: with CUDA (`device` auto with a GPU, `cuda`) replica i gets its own GPU through
``CUDA_VISIBLE_DEVICES`` (the i-th of the GPUs this process sees); with fewer GPUs than
replicas they share them round robin (each holds its own copy of the model and KV pool: a
warning says so). `device=cuda:K` pins every replica to GPU K (a warning too). On the CPU
each replica gets ``threads`` torch threads (null: the cores this process may use / N, at
least 1; with ``OMP_NUM_THREADS`` set, that many each, as one server would).

Lifetime: the launcher waits until every replica (and the router) answers `/health`, then
logs the addresses. SIGINT / SIGTERM are forwarded to every child (each stops as a server
does: streams end, then the engine), and the launcher exits 0 once they have; a launcher
killed outright takes them with it (Linux: each child gets SIGTERM when its parent dies).
A replica that dies on its own is reported with its exit code and port, the others are
stopped, and the launcher exits 1: no restart loop that would hide an out-of-memory or a
bug; the scheduler around it (SLURM's `--requeue`, systemd, Kubernetes) restarts the whole
group.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("astrai.serve")

# Keys the launcher reads and the replicas do not get (each replica is one server).
LAUNCHER_KEYS = frozenset({"replicas", "router", "router_policy", "metrics_port", "port"})
# router name -> the command that starts it (flags shared by sglang-router and vllm-router).
ROUTERS = {
    "vllm": ("vllm-router", "vllm_router"),
    "sglang": ("sglang-router", "sglang_router"),
}
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
POLL_S = 0.25


@dataclass(frozen=True)
class ReplicaPlan:
    """Where everything listens and which GPU each replica sees (None: inherited)."""

    host: str
    ports: list[int]
    visible_devices: list[str | None]
    threads: int | None
    metrics_port: int
    router: str | None = None
    router_port: int | None = None
    router_policy: str = "cache_aware"
    warnings: list[str] = field(default_factory=list)

    @property
    def local_host(self) -> str:
        """`host` as this machine reaches it in a URL: a wildcard is loopback, IPv6 in
        brackets (the launcher's health checks, the router's worker URLs)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"[{host}]" if ":" in host else host

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.local_host}:{p}" for p in self.ports]

    @property
    def address(self) -> str:
        """The one address clients use: the router's, else the first replica's."""
        port = self.router_port if self.router_port is not None else self.ports[0]
        return f"http://{self.local_host}:{port}"


def _visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _wants_cuda(device: str, gpus: Sequence[str]) -> bool:
    return device.startswith("cuda") or (device == "auto" and len(gpus) > 0)


def plan_replicas(cfg: dict[str, Any], gpus: Sequence[str] | None = None) -> ReplicaPlan:
    """The plan `cfg` describes; a bad `replicas` / `router` / `router_policy` /
    `metrics_port` is a SystemExit naming the key. `gpus`: the visible GPUs (None: ask)."""
    n = cfg.get("replicas", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SystemExit(f"replicas: expected an int >= 1, got {n!r}")
    router = cfg.get("router")
    if router is not None and router not in ROUTERS:
        raise SystemExit(f"router: expected null or one of {', '.join(ROUTERS)}, got {router!r}")
    policy = cfg.get("router_policy") or "cache_aware"
    if policy not in POLICIES:
        raise SystemExit(f"router_policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    host, port = str(cfg.get("host") or "127.0.0.1"), int(cfg.get("port") or 0)
    if port <= 0:
        raise SystemExit(f"port={port}: replicas={n} needs a fixed first port (port=8000)")
    first = port + (1 if router else 0)
    ports = list(range(first, first + n))
    metrics_port = cfg.get("metrics_port")
    metrics_port = ports[-1] + 1 if metrics_port is None else metrics_port
    if not isinstance(metrics_port, int) or not 0 < metrics_port < 65535:
        raise SystemExit(f"metrics_port: expected a port number or null, got {metrics_port!r}")
    mine = [metrics_port, *([metrics_port + 1] if router else [])]  # + the router's own
    if set(mine) & {*ports, *([port] if router else [])}:
        raise SystemExit(f"metrics_port={metrics_port}: a port a replica or the router uses")
    device = str(cfg.get("device") or "auto")
    warnings: list[str] = []
    gpus = list(_visible_gpus() if gpus is None else gpus) if device != "cpu" else []
    visible: list[str | None] = [None] * n
    if _wants_cuda(device, gpus):
        if not gpus:
            raise SystemExit(f"device={device}: no GPU visible (CUDA_VISIBLE_DEVICES, drivers)")
        if ":" in device:
            warnings.append(f"device={device}: all {n} replicas share that GPU")
        else:
            visible = [gpus[i % len(gpus)] for i in range(n)]
            if len(gpus) < n:
                warnings.append(
                    f"{n} replicas on {len(gpus)} GPU(s): they share them round robin, "
                    "each with its own copy of the model and KV pool"
                )
    threads = cfg.get("threads")
    if threads is None and not any(visible) and not os.environ.get("OMP_NUM_THREADS"):
        from astrai.runtime import available_cores

        threads = max(1, available_cores() // n)
    return ReplicaPlan(
        host=host,
        ports=ports,
        visible_devices=visible,
        threads=threads,
        metrics_port=metrics_port,
        router=router,
        router_port=port if router else None,
        router_policy=policy,
        warnings=warnings,
    )


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def replica_command(overrides: Sequence[str], plan: ReplicaPlan, i: int) -> list[str]:
    """``python -m astrai.serve`` with the launcher's overrides, less its own keys, on
    replica i's port (and device / threads where the plan sets them)."""
    extra = [f"port={plan.ports[i]}"]
    if plan.visible_devices[i] is not None:
        extra.append("device=cuda")  # the one GPU CUDA_VISIBLE_DEVICES leaves it
    if plan.threads is not None:
        extra.append(f"threads={plan.threads}")
    mine = LAUNCHER_KEYS | {_key(o) for o in extra}
    keep = [o for o in overrides if _key(o) not in mine]
    return [sys.executable, "-m", "astrai.serve", *keep, *extra]


def router_command(plan: ReplicaPlan, api_key: str | None, debug: bool = False) -> list[str]:
    """The chosen router's command line (the flags vllm-router and sglang-router share);
    its log shows warnings and errors only, everything with `debug` (log_level=debug)."""
    assert plan.router is not None and plan.router_port is not None
    binary, module = ROUTERS[plan.router]
    if plan.router == "vllm":  # vllm_router has no __main__: its console script
        found = shutil.which(binary, path=str(Path(sys.executable).parent)) or shutil.which(binary)
        if found is None:
            raise SystemExit(
                f"router={plan.router}: `{binary}` is not installed; "
                "pip install 'astrai[router]' (or pip install vllm-router)"
            )
        head = [found]
    else:
        try:
            __import__(module)
        except ImportError:
            raise SystemExit(
                f"router={plan.router}: `{module}` is not installed; pip install {binary}"
            ) from None
        head = [sys.executable, "-m", f"{module}.launch_router"]
    cmd = [
        *head,
        "--worker-urls",
        *plan.urls,
        "--policy",
        plan.router_policy,
        "--host",
        plan.host,
        "--port",
        str(plan.router_port),
        "--prometheus-host",
        plan.host,
        "--prometheus-port",
        str(plan.metrics_port + 1),
        "--log-level",
        "debug" if debug else ("warning" if plan.router == "vllm" else "warn"),
    ]
    return cmd + (["--api-key", api_key] if api_key else [])


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the launcher dies, even by SIGKILL,
    so that no replica outlives it holding its port and GPU."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class ReplicaLauncher:
    """Starts the replicas (and router), waits for them, forwards signals, stops them."""

    def __init__(
        self,
        plan: ReplicaPlan,
        overrides: Sequence[str],
        api_key: str | None,
        debug: bool = False,
    ) -> None:
        self.plan = plan
        self.commands = [replica_command(overrides, plan, i) for i in range(len(plan.ports))]
        self.router_cmd = router_command(plan, api_key, debug) if plan.router else None
        self.procs: list[subprocess.Popen] = []
        self.names: list[str] = []
        self.stop_signal: int | None = None

    def _spawn(self, cmd: list[str], name: str, visible: str | None = None) -> None:
        env = dict(os.environ)
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        # Own process group: a terminal's Ctrl-C reaches the launcher only, which forwards
        # it once (a second SIGINT would make uvicorn skip its graceful shutdown).
        linux = sys.platform.startswith("linux")
        self.procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent if linux else None,  # spawned before any thread
            )
        )
        self.names.append(name)
        where = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible}"
        logger.info("started %s: pid %d%s", name, self.procs[-1].pid, where)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _dead(self) -> tuple[str, int] | None:
        for name, proc in zip(self.names, self.procs):
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def run(self) -> int:
        """Run until a signal (exit 0) or a child's own death (exit 1)."""
        from astrai.serve.metrics_aggregate import MetricsAggregator

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        plan = self.plan
        for w in plan.warnings:
            logger.warning(w)
        aggregator = MetricsAggregator(plan.urls, plan.host, plan.metrics_port)
        started = False
        try:
            for i, cmd in enumerate(self.commands):
                self._spawn(cmd, f"replica {i} ({plan.urls[i]})", plan.visible_devices[i])
            if not self._wait(plan.urls):
                return self._finish()
            if self.router_cmd is not None:
                self._spawn(self.router_cmd, f"router {plan.router} ({plan.address})")
                if not self._wait([plan.address]):
                    return self._finish()
            aggregator.start()
            started = True
            logger.info(
                "%d replicas ready on %s%s; aggregated /metrics on %s",
                len(plan.ports),
                ", ".join(plan.urls),
                f"; {plan.router}-router ({plan.router_policy}) on {plan.address}"
                if plan.router
                else "",
                aggregator.url,
            )
            while self.stop_signal is None and self._dead() is None:
                time.sleep(POLL_S)
            return self._finish()
        finally:
            aggregator.stop(started)
            self._stop_all(signal.SIGTERM, quiet=True)

    def _wait(self, urls: Sequence[str]) -> bool:
        """Until every url is healthy (True), a signal or a child's death (False)."""
        pending = list(urls)
        while pending:
            if self.stop_signal is not None or self._dead() is not None:
                return False
            pending = [u for u in pending if not _healthy(u)]
            if pending:
                time.sleep(POLL_S)
        return True

    def _finish(self) -> int:
        dead = self._dead() if self.stop_signal is None else None
        if dead is not None:
            logger.error("%s exited with code %d: stopping the others", *dead)
        self._stop_all(self.stop_signal or signal.SIGTERM)
        if dead is None:
            logger.info("replicas stopped")
        return 0 if dead is None else 1

    def _stop_all(self, sig: int, quiet: bool = False) -> None:
        """Send `sig` to every child still running (router first), wait, kill stragglers."""
        order = list(zip(self.names, self.procs))[::-1]
        for _, proc in order:
            if proc.poll() is None:
                proc.send_signal(sig)
        deadline = time.monotonic() + 60
        for name, proc in order:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if not quiet:
                    logger.warning("%s did not stop in time: killed", name)
                proc.kill()
                proc.wait()


def launch(
    cfg: dict[str, Any], overrides: Sequence[str], check_port: Callable[[str, int], None]
) -> int:
    """`python -m astrai.serve replicas=N`: plan, check every port (`check_port`: serve's
    own check, a SystemExit naming a busy one), run; the exit code."""
    plan = plan_replicas(cfg)
    ports = [*plan.ports, plan.metrics_port]
    if plan.router_port is not None:
        ports += [plan.router_port, plan.metrics_port + 1]
    for port in ports:
        check_port(plan.host, port)
    debug = str(cfg.get("log_level", "info")).lower() == "debug"
    return ReplicaLauncher(plan, overrides, cfg.get("api_key") or None, debug).run()
