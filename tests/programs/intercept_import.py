"""``intercept(name, before, after)``: the module ``name`` is then imported by its own loader with
``before(module)`` and ``after(module)`` called around it, on whichever thread imports it, before
any post-import hook sees the module. For the test programs that play a torch whose import is
slow or whose names moved (tests/programs/moved_name.py, apply_during_replicate_import.py).
"""

from __future__ import annotations

import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Callable, Optional, Sequence


def nothing(module: ModuleType) -> None:
    pass


def intercept(name: str, before: Callable[[ModuleType], Any] = nothing,
              after: Callable[[ModuleType], Any] = nothing) -> None:
    class Intercepting:
        def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                      target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
            if fullname != name:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            assert spec is not None and spec.loader is not None
            real = spec.loader

            class Loader:
                def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
                    return None

                def exec_module(self, module: ModuleType) -> None:
                    before(module)
                    real.exec_module(module)
                    after(module)

            spec.loader = Loader()  # type: ignore[assignment]
            return spec

    sys.meta_path.insert(0, Intercepting())


def move_name(module: str, name: str) -> None:
    """``module``'s global ``name`` renamed once the module has run, as a torch that moved it."""
    intercept(module, after=lambda loaded: setattr(loaded, "moved_elsewhere", loaded.__dict__.pop(name)))
