"""What the package needs around the layout fix, beyond the fix itself.

The fix is ``_wrapper_cls.make_wrapper_cls``, the function ``upstream/torch.patch`` adds to torch
as ``torch/distributed/_wrapper_cls.py``, character for character. Around it, the package keeps:

- ``called_from``: that function called as if from torch's builder module, so the classes it
  builds carry the module name torch's own ``type(...)`` call gives them there;
- ``accepts``: CPython's verdict on torch's class for a module's class, asked as the fix asks it:
  for the status (a class torch will fail to set) and for the classes torch cached before the
  patch;
- ``ByIdentity``: tables keyed by the identity of classes, held weakly;
- ``mirror_base``: where a class built by the fix sits, as the status and the log name it.

Pure Python; no torch here.
"""

from __future__ import annotations

import functools
import types
import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

from fsdp_autopatch import _wrapper_cls

# What became of an original class at a construction site.
TORCH = "torch"  # torch's own class, which CPython accepts
COMPATIBLE = "compatible"  # CPython refuses torch's class; the fix built one that it accepts
REFUSED = "refused"  # CPython refuses torch's class and the fix has none: torch raises its error

Value = TypeVar("Value")


class ByIdentity(Generic[Value]):
    """A table keyed by the identity of its keys, held weakly: it never calls a key's ``__eq__``
    or ``__hash__`` (a user's metaclass may define them, by name or not at all), and an entry goes
    with its key. CPython calls a weak reference's callback before the key's memory, and so its
    id, can be reused."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Value]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Any) -> Optional[Value]:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None

    def set(self, key: Any, value: Value) -> None:
        entries, ident = self._entries, id(key)

        def forget(reference: weakref.ref[Any]) -> None:
            if entries.get(ident, (None,))[0] is reference:
                del entries[ident]

        entries[ident] = (weakref.ref(key, forget), value)


def in_module(function: types.FunctionType, module_name: str) -> types.FunctionType:
    """``function`` as if ``module_name`` defined it: its code, with its own module's globals
    under that module's name."""
    namespace = {**function.__globals__, "__name__": module_name}
    return types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)


def _call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return function(*args, **kwargs)


def called_from(module_name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as code in ``module_name`` calls it. ``type(name, bases, ns)`` names a new
    class's ``__module__`` after the globals of the code that calls it (or ``abc`` where
    ABCMeta's own ``__new__`` is that code), and ``make_wrapper_cls`` after its caller's, as torch's
    own ``type(...)`` call there names them."""
    return functools.partial(in_module(_call, module_name), function)  # type: ignore[arg-type]


def accepts(cls: type, new: type) -> bool:
    """Does CPython accept ``new``, a class torch built for ``cls`` (``(wrapper, cls)``), for
    instances of ``cls``? Asked as the fix asks it: of an instance of the class where the layout
    check stops on ``new``'s chain (torch's wrapper class), never of ``cls``, so that no code of
    the user's classes runs (a ``__del__`` would, on an instance of theirs)."""
    old_root, new_root = _wrapper_cls._layout_root(cls), _wrapper_cls._layout_root(new)
    return old_root is new_root or _wrapper_cls._can_switch(new_root, old_root)


def mirror_base(built: type, wrapper: type) -> type:
    """The base that the mirror of ``wrapper`` sits on in a class the fix built: ``abc.ABC``,
    ``typing.Generic``. The mirrors copy the wrapper's chain, one class each, on top of it."""
    mirror = built.__bases__[0]
    for _ in wrapper.__mro__[1:-1]:
        mirror = mirror.__bases__[0]
    return mirror.__bases__[0]  # type: ignore[no-any-return]


def parent_name(parent: type) -> str:
    """``abc.ABC``, ``typing.Generic``: how a mirror's base is named in the status and the log."""
    return f"{parent.__module__}.{parent.__qualname__}"
