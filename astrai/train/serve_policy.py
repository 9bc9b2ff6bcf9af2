"""Serving the live policy: the run's engine answers the OpenAI/Anthropic API between steps.

``serve_policy.port=8000`` on any training run starts `astrai.serve`'s app (same routes,
errors and metrics as ``python -m astrai.serve``) on rank 0, over the engine the run already
has: the module's policy engine (``LMModule.policy_engine``, which GRPO's rollouts and the
evaluation callback use too; this callback declares its sizes in ``setup``; under
``trainer=fsdp2`` it runs on full weights gathered from the shards, a gather the other ranks
join at each window: rank 0 broadcasts at every batch end whether it serves). Every OpenAI response and chunk carries ``system_fingerprint:
"policy-step-<N>"``, the policy version (GRPO's: the optimizer step count) whose weights
computed it.

The guarantee: **a response is computed by one policy version, and training never runs
while a request does.** A request waits at a gate (an ASGI middleware, before any work)
until the next end of a training batch; there :class:`PolicyServer` admits every request
waiting at that moment, switches the policy to eval mode, starts the engine's loop and
*blocks the training thread* until those requests are answered, then stops the loop and
restores the modes; requests that arrive meanwhile wait for the next batch end. Serving is
read-only: no route changes weights, the engine runs under inference mode (no gradients,
no version-counter bumps) and draws its noise from the global RNG only inside a forked
state (reseeded privately, so unseeded requests still differ), so a run's weights are the
same bit for bit with or without requests. ``max_window_s`` bounds the wait: then the
requests still generating are cut short (finish reason ``length``) and training goes on.
Nothing here loads or unloads LoRA adapters: the runtime adapter routes of `astrai.serve`
are never mounted on this server.

A bad ``serve_policy`` block (an unknown key, ``port=abc``, a busy port, a non-loopback
``host`` without ``api_key`` or ``allow_unauthenticated=true``) is one line from
`astrai.train.preflight` (`serve_policy_problems`) before the run starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from astrai.train.policy_engine import PolicyEngine

if TYPE_CHECKING:
    from fastapi import FastAPI

    from astrai.inference import InferenceEngine
    from astrai.serve.server import ServerThread

log = logging.getLogger(__name__)

#: seconds the training thread waits for the engine to clean up after a window's requests
_IDLE_GRACE_S = 30.0


@dataclasses.dataclass(frozen=True)
class PolicyServeSettings:
    """The ``serve_policy`` block of conf/train.yaml.

    `port`: None turns serving off; 0 takes any free port (the log line names it).
    `api_key`, `allow_unauthenticated`: as `python -m astrai.serve`'s (a `host` other than
    loopback needs a key, or `allow_unauthenticated: true`). `model_name`: the id `/v1/models` lists and
    responses carry (train.yaml: the run's `name`). `max_batch_size`, `max_seq_len`: what serving
    needs of the run's engine, which is built at the largest size any of its users needs
    (`max_seq_len` None: no need of its own; the engine's default is the model's context,
    at most 4096). `max_window_s`: the longest training waits for the
    requests of one window (None: no limit).
    """

    port: int | None = None
    host: str = "127.0.0.1"
    api_key: str | None = None
    model_name: str | None = None
    max_batch_size: int = 8
    max_seq_len: int | None = None
    max_window_s: float | None = 300.0
    allow_unauthenticated: bool = False

    @classmethod
    def parse(cls, settings: Mapping[str, Any] | None) -> PolicyServeSettings:
        """Settings from the config mapping; a bad one is a ValueError naming its key."""
        given = dict(settings or {})
        known = {f.name for f in dataclasses.fields(cls)}
        for key in given:
            if key not in known:
                raise ValueError(
                    f"serve_policy.{key}: unknown setting (known: {', '.join(sorted(known))})"
                )
        out = cls(**given)
        if out.port is not None:
            from astrai.serve.settings import check_listen

            check_listen(
                out.host,
                out.port,
                out.api_key,
                out.allow_unauthenticated,
                prefix="serve_policy.",
            )
        for key in ("max_batch_size", "max_seq_len"):
            value = getattr(out, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"serve_policy.{key}: must be a positive int, got {value!r}")
        if out.max_window_s is not None and not out.max_window_s > 0:
            raise ValueError(
                f"serve_policy.max_window_s: must be positive or null, got {out.max_window_s!r}"
            )
        return out


def serve_policy_problems(settings: Mapping[str, Any] | None) -> list[str]:
    """The problems of a ``serve_policy`` block, one line each (empty: fine), found without
    a model: its settings (`PolicyServeSettings.parse`), then whether its port is free."""
    from astrai.serve.__main__ import check_port

    try:
        parsed = PolicyServeSettings.parse(settings)
    except (TypeError, ValueError) as err:
        return [str(err)]
    if parsed.port is None:
        return []
    try:
        check_port(parsed.host, parsed.port)
    except SystemExit as err:  # its message names `port=`; ours, the run's key
        message = str(err).replace("another port=<n>", "another serve_policy.port=<n>")
        return [f"serve_policy.{message}"]
    return []


# ---------------------------------------------------------------------- the gate
class _Ticket:
    """One request at the gate: its event loop's future says whether it was admitted."""

    __slots__ = ("admitted", "done", "future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[bool] = loop.create_future()
        self.admitted = False
        self.done = False


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


class PolicyGate:
    """Admission of HTTP requests, decided by the training thread.

    Requests `enter` (on the server's event loop) and wait; the training thread `take`s
    every request waiting at that moment, `release`s them once the engine is ready, and
    `wait`s until each has `leave`n (its response is sent). `shutdown` refuses every
    waiting and later request.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[_Ticket] = []
        self._shut = False

    @property
    def waiting(self) -> int:
        """Requests waiting for the next window."""
        with self._cond:
            return len(self._waiting)

    def wait_for_waiting(self, n: int, timeout: float) -> bool:
        """Block until at least `n` requests wait (tests, and clients of the run's API)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._waiting) >= n, timeout)

    async def enter(self) -> _Ticket | None:
        """Wait for admission: the ticket, or None when serving has ended."""
        ticket = _Ticket(asyncio.get_running_loop())
        with self._cond:
            if self._shut:
                return None
            self._waiting.append(ticket)
            self._cond.notify_all()
        try:
            admitted = await ticket.future
        except asyncio.CancelledError:
            self.leave(ticket)
            raise
        return ticket if admitted else None

    def leave(self, ticket: _Ticket) -> None:
        with self._cond:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            ticket.done = True
            self._cond.notify_all()

    def take(self) -> list[_Ticket]:
        """Every request waiting now, admitted (not yet released)."""
        with self._cond:
            tickets, self._waiting = self._waiting, []
            for t in tickets:
                t.admitted = True
            return tickets

    @staticmethod
    def release(tickets: list[_Ticket], value: bool = True) -> None:
        for t in tickets:
            try:
                t.loop.call_soon_threadsafe(_resolve, t.future, value)
            except RuntimeError:  # its event loop is gone: the server stopped
                t.done = True

    def wait(self, tickets: list[_Ticket], timeout: float | None) -> bool:
        """Until every ticket has left (True), or `timeout` seconds (False). Waits in short
        slices, so that a signal handler (Ctrl+C) runs on the training thread meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not all(t.done for t in tickets):
                left = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self) -> None:
        with self._cond:
            self._shut = True
            tickets, self._waiting = self._waiting, []
            for t in tickets:
                t.done = True
        self.release(tickets, False)


class _GateMiddleware:
    """ASGI: every POST waits at the gate before it costs anything; GETs (/health,
    /v1/models, /metrics, /stats) pass. The innermost middleware, so the access log and
    metrics see the wait in a request's duration."""

    def __init__(self, app: Any, gate: PolicyGate, retry_after_s: int = 1) -> None:
        self.app, self.gate, self.retry_after_s = app, gate, retry_after_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        ticket = await self.gate.enter()
        if ticket is None:
            from astrai.serve.errors import APIError, error_body
            from astrai.serve.protocol import SafeJSONResponse

            err = APIError(
                503, "the live policy is not served any more (training stopped)", kind="overloaded"
            )
            headers = {"retry-after": str(self.retry_after_s)}
            body = error_body(scope.get("path", ""), err)
            await SafeJSONResponse(body, status_code=503, headers=headers)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.leave(ticket)


# ---------------------------------------------------------------------- the callback
class PolicyServer(Callback):
    """Serve the live policy over HTTP between optimizer steps (see the module docstring).

    Args:
        settings: the ``serve_policy`` block (:class:`PolicyServeSettings`); None or
            ``port: null``: nothing happens.
    """

    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.settings = PolicyServeSettings.parse(settings)
        self.gate = PolicyGate()
        self.engine: InferenceEngine | None = None
        self.owner: PolicyEngine | None = None  # the policy engine serving uses
        self.owns_engine = False  # True: a plain LightningModule's, built by this callback
        # on the other ranks: the module's policy engine, which joins rank 0's weight
        # refresh when rank 0 serves (a collective under FSDP2; nothing under DDP)
        self.follower: PolicyEngine | None = None
        self.app: FastAPI | None = None
        self.server: ServerThread | None = None
        self.version: int | None = None  # the policy version being served (None: none yet)
        self._seeds = random.SystemRandom()

    @property
    def enabled(self) -> bool:
        return self.settings.port is not None

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    @property
    def waiting(self) -> int:
        """Requests waiting for the next end of a training batch."""
        return self.gate.waiting

    def fingerprint(self) -> str | None:
        """The `system_fingerprint` of the responses now being computed."""
        return None if self.version is None else f"policy-step-{self.version}"

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        if not trainer.is_global_zero:
            from astrai.train.module import LMModule

            if isinstance(pl_module, LMModule) and self._usable(trainer, pl_module):
                self.follower = pl_module.policy_engine
            return
        # a port taken since the preflight fails now, before any step
        problems = serve_policy_problems(dataclasses.asdict(self.settings))
        if problems:
            raise ValueError(problems[0])
        if self._usable(trainer, pl_module):  # before anyone builds the engine
            self._owner(pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.enabled or not trainer.is_global_zero or not self._usable(trainer, pl_module):
            return
        from astrai.serve import ServerThread

        self.gate = PolicyGate()  # a fit after a finished one starts with an open door
        self.engine = self._owner(pl_module).engine
        self.app = app = self.build_app(self.engine)
        self.server = ServerThread(app, self.settings.host, int(self.settings.port or 0)).start()
        log.info(
            "serving the live policy at %s (model %s%s); requests are answered between "
            "optimizer steps",
            self.server.url,
            self.model_name,
            ", API key required" if self.settings.api_key else "",
        )

    @property
    def model_name(self) -> str:
        """The id `/v1/models` lists and responses carry."""
        return self.settings.model_name or "astrai-policy"

    def build_app(self, engine: InferenceEngine) -> FastAPI:
        """`astrai.serve`'s app over `engine`, behind this callback's gate. Its settings
        never allow runtime LoRA loading: the load / unload routes are not mounted."""
        from starlette.middleware import Middleware

        from astrai.serve import ServeSettings, create_app

        settings = ServeSettings(model_name=self.model_name, api_key=self.settings.api_key)
        app = create_app(engine, settings, fingerprint=self.fingerprint)
        # innermost: after the access log, the body limit and the metrics
        app.user_middleware.append(
            Middleware(_GateMiddleware, gate=self.gate, retry_after_s=settings.retry_after_s)
        )
        return app

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self.serve_waiting(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.serve_waiting(trainer)  # the final policy answers what waits, then we stop
        self.stop()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.close()  # Lightning runs no teardown hook after an exception

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving and shut down the engine if it is this callback's own (a module's
        policy engine is the module's to shut down)."""
        self.stop()
        if self.owner is not None and self.owns_engine:
            self.owner.close()
        self.owner = self.follower = None
        self.engine = None

    def stop(self) -> None:
        """Refuse waiting requests (503) and stop the HTTP server (its port closes)."""
        server, self.server = self.server, None
        if server is None:
            return
        url = server.url
        self.gate.shutdown()
        server.stop()
        log.info("stopped serving the live policy (%s)", url)

    # ------------------------------------------------------------------ engine
    def _usable(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        model = getattr(pl_module, "model", None)
        if getattr(pl_module, "tokenizer", None) is None or not isinstance(model, torch.nn.Module):
            log.warning("serve_policy: the module has no tokenizer or model; not serving")
            return False
        from torch.distributed.tensor import DTensor

        from astrai.train.module import LMModule

        # an LMModule's policy engine runs on weights gathered from FSDP2's shards; a plain
        # module's sharded weights have no such path, nor Lightning's first FSDP API's
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        if (sharded and not isinstance(pl_module, LMModule)) or _lightning_fsdp(trainer):
            log.warning("serve_policy: not supported with FSDP (sharded weights); not serving")
            return False
        return True

    def _owner(self, pl_module: L.LightningModule) -> PolicyEngine:
        """The policy engine to serve from: the module's (an ``LMModule``), else one of this
        callback's own on the live model; with serving's needs declared."""
        if self.owner is None:
            from astrai.train.module import LMModule

            self.owns_engine = not isinstance(pl_module, LMModule)
            if isinstance(pl_module, LMModule):
                self.owner = pl_module.policy_engine
            else:
                self.owner = PolicyEngine(lambda: (pl_module.model, pl_module.tokenizer))
            self.owner.need(
                "serve_policy",
                max_batch_size=self.settings.max_batch_size,
                max_seq_len=self.settings.max_seq_len,
            )
        return self.owner

    # ------------------------------------------------------------------ a window
    def serve_waiting(self, trainer: L.Trainer) -> int:
        """Answer every request waiting now with the current weights, on this (the
        training) thread's time; returns how many were admitted. On the other ranks: take
        part in rank 0's weight refresh when it serves (under FSDP2 a collective)."""
        if self.follower is not None:
            if self.follower.weights.rank0_decides(False):
                self.follower.join(int(trainer.global_step))
            return 0
        engine = self.engine
        if self.server is None or engine is None or self.owner is None:
            return 0
        tickets = self.gate.take()
        if not self.owner.weights.rank0_decides(bool(tickets)):
            return 0
        started = time.perf_counter()
        engine = self.owner.sync(int(trainer.global_step))
        self.version = engine.policy_version
        # Eval mode for the window, as `astrai.serve` runs an export: the engine shares the
        # module Lightning keeps in train mode, whose LoRA dropout would otherwise drop
        # activations of the answers (and draw from the RNG); restored before training goes on.
        model = engine.model
        modes = [(m, m.training) for m in model.modules()]
        device = engine.device
        devices = [device] if device.type == "cuda" else []
        released = False
        with torch.random.fork_rng(devices=devices):
            _reseed(self._seeds.getrandbits(63), device)
            try:
                model.eval()
                engine.start()
                self.gate.release(tickets)
                released = True
                if not self.gate.wait(tickets, self.settings.max_window_s):
                    self._cut_short(tickets)
                self._wait_idle(engine)
            finally:
                if not released:  # the window failed to open: refused (503), not left hanging
                    self.gate.release(tickets, False)
                engine.stop()
                if engine.scheduler.has_work():  # never left for the training thread to run
                    engine.scheduler.cancel_all()
                    engine.scheduler.cleanup()
                for m, mode in modes:
                    m.training = mode
        log.debug(
            "served %d request(s) with %s in %.2f s",
            len(tickets),
            self.fingerprint(),
            time.perf_counter() - started,
        )
        return len(tickets)

    def _cut_short(self, tickets: list[_Ticket]) -> None:
        open_ = sum(not t.done for t in tickets)
        log.warning(
            "serve_policy: %d request(s) still open after max_window_s=%s; cutting them short "
            "so that training goes on",
            open_,
            self.settings.max_window_s,
        )
        if self.app is not None:
            self.app.state.astrai.cancel_all()
        self.gate.wait(tickets, _IDLE_GRACE_S)  # their streams end; a stalled client may not

    @staticmethod
    def _wait_idle(engine: InferenceEngine) -> None:
        """Until the loop has ended the window's tasks (cancelled ones are freed after the
        response was sent)."""
        deadline = time.monotonic() + _IDLE_GRACE_S
        while engine.scheduler.has_work() and engine.running and time.monotonic() < deadline:
            time.sleep(0.002)


def _reseed(seed: int, device: torch.device) -> None:
    """Fresh noise for unseeded requests inside the forked RNG: without it every window
    would start from the training RNG's (unchanged) state and repeat its draws."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[index].manual_seed(seed)


def _lightning_fsdp(trainer: L.Trainer) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(trainer.strategy, FSDPStrategy)
