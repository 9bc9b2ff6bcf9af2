"""HTTP serving: OpenAI- and Anthropic-compatible API over an `InferenceEngine`.

`create_app(engine, settings)` builds the FastAPI app; `python -m astrai.serve
model=<dir>` loads a model directory and serves it (config `conf/serve.yaml`).
"""

from astrai.serve.app import create_app
from astrai.serve.errors import APIError
from astrai.serve.handler import ProtocolHandler, ResponseBuilder
from astrai.serve.parsing import OutputParser, StopMatcher, ToolCallFormat, ToolCallParser
from astrai.serve.server import Server, ServerThread
from astrai.serve.settings import ServeSettings

__all__ = [
    "APIError",
    "OutputParser",
    "ProtocolHandler",
    "ResponseBuilder",
    "ServeSettings",
    "Server",
    "ServerThread",
    "StopMatcher",
    "ToolCallFormat",
    "ToolCallParser",
    "create_app",
]
