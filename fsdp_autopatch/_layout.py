"""What the package needs around the layout fix, beyond the fix itself.

The fix is ``_wrapper_cls.make_wrapper_cls``, the function ``upstream/torch.patch`` adds to torch
as ``torch/distributed/_wrapper_cls.py``, character for character. Around it, the package keeps:

- ``in_module``: that function run as if torch's builder module defined it. ``type(name, bases,
  ns)`` names a new class's ``__module__`` after the globals of the code that calls it (or
  ``abc`` where ABCMeta's own ``__new__`` is that code), so the classes it builds carry the
  module name torch's own ``type(...)`` call gives them there;
- ``accepts``: CPython's verdict on a class for a module's class, asked of an uninitialised
  instance that no one else sees: for the status (a class torch will fail to set) and for the
  classes torch cached before the patch;
- ``ByIdentity``: tables keyed by the identity of classes, held weakly;
- ``mirror_base``: where a class built by the fix sits, as the status and the log name it.

Pure Python; no torch here.
"""

from __future__ import annotations

import logging
import types
import weakref
from typing import Any, Callable, Generic, Optional, TypeVar

from fsdp_autopatch import _wrapper_cls

# What became of an original class at a construction site.
TORCH = "torch"  # torch's own class, which CPython accepts
COMPATIBLE = "compatible"  # CPython refuses torch's class; the fix built one that it accepts
REFUSED = "refused"  # CPython refuses torch's class and the fix has none: torch raises its error

Value = TypeVar("Value")

logger = logging.getLogger("fsdp_autopatch")


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
    under that module's name, so that the classes its ``type(...)`` call builds are named after
    ``module_name``, as torch's own call there names them."""
    namespace = {**function.__globals__, "__name__": module_name}
    return types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                              function.__closure__)


def _call_type(*args: Any, **kwargs: Any) -> Any:
    return type(*args, **kwargs)


def type_called_from(module_name: str) -> Callable[..., Any]:
    """``type`` as code in ``module_name`` calls it."""
    return in_module(_call_type, module_name)  # type: ignore[arg-type]


def _probe_instance(cls: type) -> Optional[object]:
    """An uninitialised instance of ``cls`` to try class swaps on, or None where none can be made
    safely: ``object.__new__`` refuses abstract classes and classes whose C base has its own
    ``__new__``, and a ``__del__`` would later run on the uninitialised instance."""
    if getattr(cls, "__del__", None) is not None:
        return None
    try:
        return object.__new__(cls)
    except TypeError:
        return None


def _swap_allowed(instance: object, new: type) -> bool:
    """Does CPython accept ``instance.__class__ = new``? The instance keeps its class."""
    old = type(instance)
    try:
        _wrapper_cls._SET_CLASS(instance, new)
    except TypeError:
        return False
    _wrapper_cls._SET_CLASS(instance, old)  # the check is symmetric: what went one way goes back
    return True


def _own_slots(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    return tuple(name for name in names if name not in ("__dict__", "__weakref__"))


def _swap_accepted(old: type, new: type) -> bool:
    """Would CPython 3.9 - 3.14 accept ``instance_of_old.__class__ = new``? The rule as
    ``compatible_for_assignment`` states it, for classes of which no instance can be made."""
    old_root, new_root = _wrapper_cls._layout_root(old), _wrapper_cls._layout_root(new)
    if old_root is new_root:
        return True
    return (
        old_root.__base__ is new_root.__base__
        and old_root.__basicsize__ == new_root.__basicsize__
        and _own_slots(old_root) == _own_slots(new_root)
    )


def accepts(cls: type, new: type) -> bool:
    """Does CPython accept ``new`` for instances of ``cls``? Asked of an uninitialised instance,
    or, for a class of which none can be made safely, judged by the rule (``_swap_accepted``)."""
    instance = _probe_instance(cls)
    if instance is not None:
        return _swap_allowed(instance, new)
    logger.debug("no instance of %s can be made to ask CPython; judging its layout by the rule "
                 "as CPython 3.9-3.14 state it", cls.__qualname__)
    return _swap_accepted(cls, new)


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
