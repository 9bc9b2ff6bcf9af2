"""astrai: compose an LLM experiment from YAML, train it with Lightning, serve it over HTTP."""

from importlib.metadata import PackageNotFoundError, version

try:  # pyproject.toml is the one home of the version number
    __version__ = version("astrai")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
