"""Lazy package exports (PEP 562): a package names its public face without importing the modules behind it.

A family's package re-exports its building blocks, which import torch; importing them eagerly in its
`__init__` would load torch for any module of the package, including its light checks (dmd2/family.py,
`Registration.checks`), which the CLI runs before anything heavy loads.
"""

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, list[str]]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose names `exports` maps from its submodules, e.g.
    {"data": ["IMAGE_SHAPE", "load_digits_splits"]}: each submodule is imported on first use of a name."""
    home = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(home)

    return __getattr__, __dir__
