"""The layout fix: CPython's rule for ``obj.__class__ = new`` and a wrapper class that obeys it.

``fully_shard`` swaps a module's class for ``type(f"FSDP{name}", (FSDPModule, cls), ns)``.
CPython (``compatible_for_assignment`` in Objects/typeobject.c) accepts the swap only when both
classes have the same *layout chain*: follow ``__base__`` while a class adds nothing to the
instance layout; the class where each walk stops must be the same, or both must sit on the same
``__base__`` and add the same slots. ``class Head(ABC, nn.Module)`` adds ``__dict__`` on top of
``ABC`` (empty ``__slots__``) while ``FSDPModule`` adds it on top of ``object``, so the walks end
on different bases and the swap is refused.

The fix builds, per layout parent ``P`` (``ABC``, ``Generic[T]``, a ``collections.abc`` mixin),
a mirror of the wrapper's class chain that sits on ``P``: ``FSDPModule'(P, FSDPModule)`` carrying
``FSDPModule``'s own attributes. The wrapper class for ``cls`` is then
``type(f"FSDP{name}", (FSDPModule', cls), ns)``: its layout chain matches, it is still a
subclass of ``FSDPModule``, the original class keeps its MRO index, and every name
``FSDPModule`` defines resolves before the original class, as in upstream's MRO.

Pure Python; no torch here.
"""

from __future__ import annotations

import builtins
import types
import typing
from typing import Any, Callable, Optional

# CPython type flags (Include/object.h), stable since 3.0.
_HEAPTYPE = 1 << 9
_HAVE_GC = 1 << 14
_LAYOUT_ATTRIBUTES = ("__basicsize__", "__itemsize__", "__dictoffset__", "__weakrefoffset__")
# Attributes that type() creates for every class; copying them would alias the original's.
_NOT_COPIED = frozenset(
    {"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__slots__",
     "__abstractmethods__", "_abc_impl", "__orig_bases__", "__parameters__"}
)
_GENERIC_PARAMETER = typing.TypeVar("_GENERIC_PARAMETER")


def _adds_nothing(cls: type) -> bool:
    """CPython's ``compatible_with_tp_base``: ``cls`` has its base's instance layout."""
    base = cls.__base__
    if base is None:
        return False
    same_sizes = all(getattr(cls, name) == getattr(base, name) for name in _LAYOUT_ATTRIBUTES)
    return same_sizes and (cls.__flags__ & _HAVE_GC) == (base.__flags__ & _HAVE_GC)


def layout_root(cls: type) -> type:
    """The class where CPython's layout walk stops: the one that last changed the layout."""
    while _adds_nothing(cls):
        cls = cls.__base__  # type: ignore[assignment]
    return cls


def _own_slots(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    return tuple(name for name in names if name not in ("__dict__", "__weakref__"))


def _adds_fields(cls: type) -> bool:
    """CPython's ``extra_ivars``: ``cls`` adds storage beyond ``__dict__``/``__weakref__``."""
    base = cls.__base__
    if base is None:
        return False
    if cls.__flags__ & _HEAPTYPE:
        return bool(_own_slots(cls))
    return cls.__basicsize__ != base.__basicsize__ or cls.__itemsize__ != base.__itemsize__


def solid_base(cls: type) -> type:
    """CPython's ``solid_base``: the nearest class on the ``__base__`` chain that adds fields."""
    while cls.__base__ is not None and not _adds_fields(cls):
        cls = cls.__base__
    return cls


def swap_accepted(old: type, new: type) -> bool:
    """Would CPython accept ``instance_of_old.__class__ = new``? (``compatible_for_assignment``)"""
    old_root, new_root = layout_root(old), layout_root(new)
    if old_root is new_root:
        return True
    return (
        old_root.__base__ is new_root.__base__
        and old_root.__basicsize__ == new_root.__basicsize__
        and _own_slots(old_root) == _own_slots(new_root)
    )


def layout_parent_to_match(wrapper: type, cls: type) -> Optional[type]:
    """The base a wrapper mirror must sit on for ``(wrapper, cls)`` to accept ``cls`` instances.

    None when upstream's ``type(name, (wrapper, cls), ns)`` is accepted as it is. The new
    class's ``__base__`` is ``wrapper`` unless ``cls`` has a more derived solid base
    (CPython's ``best_base``); only then can the two layout walks end on different bases.
    """
    if solid_base(cls) is not solid_base(wrapper):
        return None
    wrapper_root, cls_root = layout_root(wrapper), layout_root(cls)
    if wrapper_root is cls_root or cls_root.__base__ is wrapper_root.__base__:
        return None
    return cls_root.__base__


def _functions(value: Any) -> list[types.FunctionType]:
    """The plain functions behind a class attribute (methods, static/class methods, properties)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType)]
    return [value] if isinstance(value, types.FunctionType) else []


def super_call_names(cls: type) -> set[str]:
    """Names that ``cls``'s own methods may look up through zero-argument ``super()``."""
    names: set[str] = set()
    for value in cls.__dict__.values():
        for function in _functions(value):
            if "__class__" in function.__code__.co_freevars:
                names.update(function.__code__.co_names)
    return names


def _mirror_class(original: type, base: type) -> type:
    """``original``'s name and own attributes on a class whose bases are ``(base, original)``.

    The copied methods keep their ``__class__`` cell, so ``super()`` in them continues after
    the real ``original``, exactly where upstream's MRO continues after it.
    """

    def fill(namespace: dict[str, Any]) -> None:
        namespace.update(
            (name, value) for name, value in original.__dict__.items() if name not in _NOT_COPIED
        )
        namespace["__module__"] = original.__module__
        namespace["__qualname__"] = original.__qualname__
        namespace["__doc__"] = original.__doc__

    # typing.Generic refuses to be subclassed bare; Generic[T] puts the same class in the bases.
    first = typing.Generic[_GENERIC_PARAMETER] if base is typing.Generic else base
    return types.new_class(original.__name__, (first, original), exec_body=fill)


class WrapperMirrors:
    """Per (wrapper, layout parent), the mirror of the wrapper's class chain sitting on that parent.

    Built once and shared by every original class with that parent; thread safe through the
    caller's lock (class construction in torch runs under its own, see ``_patch``).
    """

    def __init__(self) -> None:
        self._mirrors: dict[tuple[type, type], type] = {}

    def get(self, wrapper: type, parent: type) -> type:
        key = (wrapper, parent)
        mirror = self._mirrors.get(key)
        if mirror is None:
            chain = [c for c in reversed(wrapper.__mro__) if c is not object]
            if any(len(c.__bases__) != 1 for c in chain):
                raise TypeError(f"{wrapper.__qualname__} has multiple bases; cannot mirror it")
            mirror = parent
            for original in chain:
                mirror = _mirror_class(original, mirror)
            self._mirrors[key] = mirror
        return mirror


def _call_type(*args: Any, **kwargs: Any) -> Any:
    return type(*args, **kwargs)


def type_called_from(module_name: str) -> Callable[..., Any]:
    """``type`` as called from code in ``module_name``.

    ``type(name, bases, ns)`` names the new class's ``__module__`` after the globals of the
    frame that calls it (unless a metaclass's own ``__new__`` is that frame, as with ABCMeta),
    so classes built through this carry the module name upstream's would.
    """
    return types.FunctionType(
        _call_type.__code__, {"__name__": module_name, "__builtins__": builtins.__dict__}
    )


def build_wrapper_class(
    mirrors: WrapperMirrors, wrapper: type, cls: type, name: str, namespace: dict[str, Any],
    module_name: str,
) -> Optional[type]:
    """The class upstream should have built for ``cls`` in ``module_name``, or None where
    upstream's is accepted.

    Raises TypeError when no compatible class can be built (e.g. a ``typing.Protocol`` parent).
    """
    parent = layout_parent_to_match(wrapper, cls)
    if parent is None:
        return None
    bases = (mirrors.get(wrapper, parent), cls)
    new_cls = type_called_from(module_name)(name, bases, dict(namespace))
    if not swap_accepted(cls, new_cls):
        raise TypeError(f"built {name} but its layout still differs from {cls.__qualname__}")
    _check_super_calls(new_cls, wrapper)
    return new_cls


def _check_super_calls(new_cls: type, wrapper: type) -> None:
    """Refuse a class in which ``super()`` from a wrapper method would skip the original's code.

    In the built MRO the original class's head (``cls`` down to the layout parent) sits between
    the mirrors and the real wrapper classes; upstream puts it right after the wrapper. A
    ``super()`` call that upstream would resolve in that head resolves past it here.
    """
    mro = new_cls.__mro__
    chain_length = len(wrapper.__mro__) - 1
    head = mro[1 + chain_length : mro.index(wrapper.__mro__[-2])]
    for real in wrapper.__mro__[:-1]:
        for name in super_call_names(real):
            for between in head:
                if name in between.__dict__:
                    raise TypeError(
                        f"{between.__qualname__} defines {name}, which "
                        f"{real.__qualname__}'s super() call would skip in {new_cls.__name__}"
                    )
