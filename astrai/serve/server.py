"""Running the app: a uvicorn `Server` that ends open streams cleanly, and a thread runner."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger("astrai.serve")


class Server(uvicorn.Server):
    """uvicorn, plus: on shutdown, first cancel every open request.

    uvicorn waits for open connections before it stops; cancelling their engine tasks
    makes each stream send its finish events and `[DONE]` at once, instead of being cut
    off mid-event when `timeout_graceful_shutdown` expires.
    """

    async def shutdown(self, sockets: Any = None) -> None:
        app = self.config.app
        state = getattr(getattr(app, "state", None), "astrai", None)
        if state is not None:
            logger.info("shutting down: ending %d open request(s)", len(state.inflight))
            state.begin_shutdown()
        await super().shutdown(sockets=sockets)
        if state is not None:
            state.close()  # the tokenizer pool


class ServerThread:
    """`Server` on 127.0.0.1 in a background thread (tests, benchmarks); port 0 = any free."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, **kwargs: Any):
        # uvicorn's own access log stays off: astrai.serve.access logs each request once.
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            **kwargs,
        )
        self.server = Server(config)
        self.thread = threading.Thread(target=self.server.run, name="astrai-http", daemon=True)
        self.host = host

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
