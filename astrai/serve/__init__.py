"""HTTP serving: OpenAI- and Anthropic-compatible API over an `InferenceEngine`.

`create_app(engine, settings)` builds the FastAPI app; `python -m astrai.serve
model_path=<dir>` loads a model directory and serves it (config `conf/serve.yaml`).
The names below are imported on first use (`astrai.lazy`): `python -m astrai.serve`
imports this package first, and must check its options and the port before FastAPI, the
engine and torch are imported.
"""

from typing import TYPE_CHECKING

from astrai.lazy import lazy_exports

if TYPE_CHECKING:
    from astrai.serve.app import create_app
    from astrai.serve.errors import APIError
    from astrai.serve.handler import ProtocolHandler
    from astrai.serve.protocol import ResponseBuilder
    from astrai.serve.server import Server, ServerThread
    from astrai.serve.settings import ServeSettings
    from astrai.serve.tool_parsers import OutputParser, StopMatcher, ToolParserChoice

__getattr__ = lazy_exports(
    globals(),
    {
        "astrai.serve.app": ("create_app",),
        "astrai.serve.errors": ("APIError",),
        "astrai.serve.handler": ("ProtocolHandler",),
        "astrai.serve.protocol": ("ResponseBuilder",),
        "astrai.serve.server": ("Server", "ServerThread"),
        "astrai.serve.settings": ("ServeSettings",),
        "astrai.serve.tool_parsers": ("OutputParser", "StopMatcher", "ToolParserChoice"),
    },
)

__all__ = [
    "APIError",
    "OutputParser",
    "ProtocolHandler",
    "ResponseBuilder",
    "ServeSettings",
    "Server",
    "ServerThread",
    "StopMatcher",
    "ToolParserChoice",
    "create_app",
]
