"""A module that builds wrapper classes as torch's sites do, for the tests of ``_patch`` that need
no torch. ``tests/test_patch.py`` loads it afresh for each test, under a name of its own, so that
each test patches (and reloads) a module nobody else holds.

Like torch's builders, ``wrap`` calls the global ``type`` both to build the class and to check
one, and reads an attribute that is also called ``type`` (``device.type``).
"""

from __future__ import annotations

from typing import Any


class Wrapper:
    """Stands in for FSDPModule: a plain class that adds ``__dict__`` on top of ``object``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        original = cls.__mro__[2]
        return original.__new__(original)


def deepcopy(*args: Any) -> None:
    raise AssertionError("not deep-copied in these tests")


class Device:
    type = "cpu"


def wrap(module: Any, device: type = Device) -> type:
    """Swap ``module``'s class for ``W<Name>(Wrapper, <Name>)``, as fully_shard does."""
    module.device_kind = device.type
    cls = module.__class__
    if not isinstance(cls, type):
        raise TypeError(f"not a class: {type(cls)}")
    module.__class__ = type(f"W{cls.__name__}", (Wrapper, cls), {"__deepcopy__": deepcopy})
    return module.__class__
