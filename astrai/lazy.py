"""Package attributes imported on first use (PEP 562), so that `python -m astrai.<cmd>`
can check its configuration before torch, the model code or the web app are imported.

A package lists what it exports and where it lives::

    __getattr__ = lazy_exports(globals(), {"astrai.serve.app": ("create_app",)})

`from astrai.serve import create_app` and `astrai.serve.create_app` then import
`astrai.serve.app` the first time they are used; the value is cached in the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, Iterable[str]]
) -> Callable[[str], Any]:
    """A module `__getattr__` for `namespace` (the package's `globals()`) that imports
    `exports` ({module: names}) on first use."""
    where = {name: module for module, names in exports.items() for name in names}
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # next time a plain attribute: no call
        return value

    return __getattr__
