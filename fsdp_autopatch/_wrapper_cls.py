"""
Wrapper classes that Python lets a module switch to in place.

``fully_shard``, FSDP's ``replicate`` and composable DDP's ``replicate`` wrap a
module by setting ``module.__class__`` to a class with the bases
``(wrapper_cls, type(module))``. Python allows that only between classes whose
instances have the same layout. A module class that puts a base with empty
``__slots__`` (``abc.ABC``, ``typing.Generic[T]``, a ``collections.abc`` class)
ahead of ``nn.Module`` adds its ``__dict__`` on top of that base, while
``wrapper_cls`` adds its own on top of ``object``: Python refuses the switch
("object layout differs"). For such a module, ``make_wrapper_cls`` puts a mirror
of ``wrapper_cls`` that sits on that base first instead.

No code of the module's classes runs here beyond what ``type(name, bases,
namespace)`` runs for the one class each call builds: their fields are read as
CPython keeps them (never through a metaclass), Python is asked with instances
of the wrapper class and of a class of this module's, and mirrors are built on
a class of this module's and then moved onto their base by ``__bases__``
assignment, which checks layouts as ``__class__`` assignment does and calls no
class hook.
"""

# https://github.com/pytorch/pytorch/issues/160068

from __future__ import annotations

import functools
import os
import sys
import threading
import types
import typing
import weakref
from typing import Any


__all__ = ["make_wrapper_cls"]

# A class's fields as CPython keeps them: reading them runs no ``__getattribute__``
# or property of its metaclass.
_BASE = type.__dict__["__base__"].__get__
_BASES = type.__dict__["__bases__"].__get__
_MRO = type.__dict__["__mro__"].__get__
_DICT = type.__dict__["__dict__"].__get__
_NAME = type.__dict__["__name__"].__get__
_FLAGS = type.__dict__["__flags__"].__get__
# The fields of a class that make up the layout of its instances.
_LAYOUT_FIELDS = tuple(
    type.__dict__[field].__get__
    for field in (
        "__basicsize__",
        "__itemsize__",
        "__dictoffset__",
        "__weakrefoffset__",
    )
)
# ``Py_TPFLAGS_HAVE_GC``, which Python also compares along a layout chain.
_HAVE_GC = 1 << 14
# ``object``'s own ``__class__`` setter: Python's layout check, whatever
# ``__class__`` or ``__setattr__`` the classes define.
_SET_CLASS = object.__dict__["__class__"].__set__
# What every class holds for itself rather than for its instances.
_CLASS_ATTRS = frozenset(
    {
        "__abstractmethods__",
        "__annotate__",
        "__annotate_func__",
        "__annotations__",
        "__annotations_cache__",
        "__dict__",
        "__doc__",
        "__firstlineno__",
        "__module__",
        "__orig_bases__",
        "__parameters__",
        "__qualname__",
        "__slots__",
        "__static_attributes__",
        "__type_params__",
        "__weakref__",
        "_abc_impl",
    }
)
# Mirrors by (wrapper class, base, names they forward), kept while a class uses
# one. Keyed by id, so that no metaclass ``__eq__`` runs; a mirror holds both
# classes, so their ids stay theirs while it lives.
_mirrors: weakref.WeakValueDictionary[tuple[int, int, frozenset[str]], type] = (
    weakref.WeakValueDictionary()
)
# Held while a mirror is looked up and built, so that every module on a base
# gets the same one. Building one runs no code of the module's classes.
_mirrors_lock = threading.RLock()


def _reset_mirrors_lock() -> None:
    # A thread that held the lock at fork() does not exist in the child.
    global _mirrors_lock
    _mirrors_lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_mirrors_lock)
# Looked up on a wrapper class when it does not define the name.
_MISSING = object()


class _Unplaced:
    """Where a mirror is built before it moves onto its base."""

    __slots__ = ()


# ``typing.Generic`` can be a base only with parameters.
_T = typing.TypeVar("_T")


class _UnplacedGeneric(typing.Generic[_T]):
    """
    Where a mirror of a ``typing.Generic`` base is built: from Python 3.15,
    ``__bases__`` assignment walks a layout chain only down to the first class
    defined in C, which ``typing.Generic`` is.
    """

    __slots__ = ()


def make_wrapper_cls(
    name: str, bases: tuple[type, type], namespace: dict[str, Any]
) -> type:
    """
    Build the class that a module wrapped in place switches to.

    Called in place of ``type(name, bases, namespace)``, it returns exactly
    that class wherever Python allows a module of class ``cls`` to switch to
    it. Where Python refuses it, the first base is a mirror of ``wrapper_cls``
    that sits on the base under ``cls``'s ``__dict__`` instead, so that the
    layouts match: ``isinstance(module, wrapper_cls)`` still holds, ``cls``
    keeps its index in the MRO (``wrapper_cls._orig_cls_mro_index``), and the
    wrapper's attributes resolve ahead of ``cls``'s. Where no mirror fits, it
    returns ``type(name, bases, namespace)``, and the switch raises as before.

    Each call builds one class. The first call for a wrapper class, a base and
    the names the module's classes define ahead of the wrapper's also builds
    their mirror, one class per class of the wrapper's MRO but ``object``,
    shared by every later call for them while a class built on it lives.

    Args:
        name (str): The name of the class.
        bases (tuple[type, type]): ``(wrapper_cls, cls)``: the wrapper class
            and the module's class.
        namespace (dict[str, Any]): The namespace of the class.

    Returns:
        type: The class to set ``module.__class__`` to.
    """
    wrapper_cls, cls = bases
    mirror = _mirror_for(wrapper_cls, cls)
    if mirror is not None:
        bases = (mirror, cls)
    # ``type()`` names a class after the module of the code that calls it (or
    # of its metaclass's ``__new__``, such as ``abc``): called from the
    # caller's module, the class is named as if the caller had called it.
    return _type_called_from(sys._getframe(1).f_globals)(name, bases, namespace)


def _call_type(
    name: str, bases: tuple[type, ...], namespace: dict[str, Any], type: type = type
) -> type:
    return type(name, bases, namespace)


def _type_called_from(module_globals: dict[str, Any]) -> types.FunctionType:
    """Return ``type`` as code with the globals ``module_globals`` calls it."""
    return types.FunctionType(
        _call_type.__code__, module_globals, "type", _call_type.__defaults__
    )


def _mirror_for(wrapper_cls: type, cls: type) -> type | None:
    """
    Return the mirror of ``wrapper_cls`` to put ahead of ``cls``, or None where
    ``(wrapper_cls, cls)`` is the class to build.
    """
    root = _layout_root(cls)
    wrapper_root = _layout_root(wrapper_cls)
    chain = _MRO(wrapper_cls)[:-1]
    if (
        _BASE(root) is None
        or _BASE(root) is object
        or any(len(_BASES(wrapper)) != 1 for wrapper in chain)
        # ``root`` adds what ``wrapper_root`` adds: ``__dict__`` and ``__weakref__``.
        or _layout(root) != _layout(wrapper_root)
        or not _adds_nothing_to_object(_BASE(root))
        or not _adds_nothing_to_object(_BASE(wrapper_root))
        # Python 3.15+ allows the switch for some bases (``abc.ABC``).
        or _can_switch(wrapper_root, root)
    ):
        return None
    # The mirror sits on the base under ``root``'s ``__dict__``; where Python's
    # check walks further (3.15+, down to a C type such as ``typing.Generic``),
    # on the base where it stops.
    base = _BASE(root)
    while base is not object:
        ahead = _ahead_of_wrappers(chain, base, cls)
        shadowed = None if ahead is None else _shadowed_attrs(chain, ahead)
        if shadowed is None:
            return None
        start = _start_fitting(base, root)
        if start is not None:
            return _mirror(chain, base, shadowed, start)
        base = _BASE(base)
    return None


def _layout(cls: type) -> tuple[int, ...]:
    return (*(field(cls) for field in _LAYOUT_FIELDS), _FLAGS(cls) & _HAVE_GC)


def _layout_root(cls: type) -> type:
    """Return the class where Python's layout check stops on ``cls``'s chain."""
    while _BASE(cls) is not None and _layout(cls) == _layout(_BASE(cls)):
        cls = _BASE(cls)
    return cls


def _adds_nothing_to_object(cls: type) -> bool:
    fields = _layout(object)[:-1]
    while cls is not object:
        if _layout(cls)[:-1] != fields:
            return False
        cls = _BASE(cls)
    return True


def _can_switch(wrapper: type, cls: type) -> bool:
    """
    Return whether Python allows an instance of the wrapper class ``wrapper``
    to switch to ``cls``, asked of a new instance that no one else sees. It
    switches back, so that it ends as it began: the module's classes never
    see it.
    """
    try:
        obj = object.__new__(wrapper)
    except TypeError:  # an abstract class: leave the module to the switch itself
        return True
    try:
        _SET_CLASS(obj, cls)
    except TypeError:
        return False
    _SET_CLASS(obj, wrapper)
    return True


def _start_fitting(base: type, cls: type) -> type | None:
    """
    Return the class to build a mirror on before it moves onto ``base`` (where
    it then adds ``__dict__``, as ``cls`` does), or None where no mirror would
    fit: where Python refuses the move, or an instance of ``cls`` the switch.

    Asked of a copy of the mirror's layout, a class of this module's with an
    instance: the copy moves onto ``base``, its instance switches to ``cls`` and back, and
    the copy moves back before the instance goes, whatever happens in between, so
    that it goes as an instance of a class of this module's alone (no
    ``__del__`` of the module's classes runs on it).
    """
    for start in (_Unplaced, _UnplacedGeneric):
        layout = type("_MirrorLayout", (start,), {"__module__": __name__})
        obj = object.__new__(layout)
        try:
            layout.__bases__ = (base,)
        except TypeError:
            continue
        try:
            _SET_CLASS(obj, cls)
            return start
        except TypeError:
            continue
        finally:
            if type(obj) is not layout:
                _SET_CLASS(obj, layout)
            layout.__bases__ = (start,)
    return None


def _ahead_of_wrappers(
    chain: tuple[type, ...], base: type, cls: type
) -> list[type] | None:
    """
    Return the classes that the class built on a mirror of ``chain`` on
    ``base`` puts ahead of the wrapper classes in its MRO: ``cls``'s classes
    that C3 places before them. None where ``cls``'s metaclass makes MROs of
    its own, which no mirror can foresee.
    """
    if any("mro" in _DICT(meta) for meta in _MRO(type(cls)) if meta is not type):
        return None
    # Each mirror's MRO, from the bottom one on ``base`` up, then the built
    # class's; an object stands in for each mirror.
    under, line = base, list(_MRO(base))
    for wrapper in reversed(chain):
        merged = _c3([line, list(_MRO(wrapper)), [under, wrapper]])
        if merged is None:
            return None
        under = object()
        line = [under, *merged]
    built = _c3([line, list(_MRO(cls)), [under, cls]])
    if built is None:
        return None
    ahead = built[: next(i for i, c in enumerate(built) if c is chain[0])]
    return [c for c in ahead if isinstance(c, type)]


def _c3(sequences: list[list[Any]]) -> list[Any] | None:
    """
    Return the C3 merge of ``sequences``, as ``type.mro()`` merges its bases'
    MROs, comparing classes by identity; None where no order exists.
    """
    merged = []
    sequences = [sequence for sequence in sequences if sequence]
    while sequences:
        for sequence in sequences:
            head = sequence[0]
            if not any(c is head for other in sequences for c in other[1:]):
                break
        else:
            return None
        merged.append(head)
        sequences = [
            sequence[1:] if sequence[0] is head else sequence for sequence in sequences
        ]
        sequences = [sequence for sequence in sequences if sequence]
    return merged


def _shadowed_attrs(
    chain: tuple[type, ...], ahead: list[type]
) -> frozenset[str] | None:
    """
    Return the attributes of the wrapper classes that the classes ``ahead`` of
    them in the new MRO also define, or None where a mirror cannot resolve one
    as ``(wrapper_cls, cls)`` does.
    """
    ahead_attrs = {attr for ahead_cls in ahead for attr in _DICT(ahead_cls)}
    shadowed = set()
    for wrapper in chain:
        for attr, value in _DICT(wrapper).items():
            if attr in _CLASS_ATTRS or attr not in ahead_attrs:
                continue
            # ``super()`` in the wrapper's method would skip ``cls``'s own, and
            # a data descriptor would have to win over the instance ``__dict__``.
            func = getattr(value, "__func__", value)
            code = getattr(func, "__code__", None)
            if hasattr(type(value), "__set__") or (
                code is not None and "__class__" in code.co_freevars
            ):
                return None
            shadowed.add(attr)
    return frozenset(shadowed)


def _mirror(
    chain: tuple[type, ...], base: type, shadowed: frozenset[str], start: type
) -> type | None:
    """
    Return the copy of the wrapper classes ``chain`` stacked on ``base``: for
    ``(FSDPModule,)`` on ``abc.ABC``, ``ABCFSDPModule(ABC, FSDPModule)``.
    """
    key = (id(chain[0]), id(base), shadowed)
    with _mirrors_lock:
        mirror = _mirrors.get(key)
        if mirror is None:
            mirror = _build_mirror(chain, base, shadowed, start)
            if mirror is not None:
                _mirrors[key] = mirror
    return mirror


def _build_mirror(
    chain: tuple[type, ...], base: type, shadowed: frozenset[str], start: type
) -> type | None:
    """
    Build the mirror on ``start`` and move it onto ``base``, so that none of
    ``base``'s class hooks (``__init_subclass__``, its metaclass) runs for it.
    """
    mirror = start
    for wrapper in reversed(chain):
        name = f"{_NAME(base)}{_NAME(wrapper)}"
        namespace = {
            "__module__": _DICT(wrapper).get("__module__"),
            "__qualname__": name,
            "__doc__": _DICT(wrapper).get("__doc__"),
        }
        mirror = type(name, (mirror, wrapper), namespace)
    # Set after the class is made, so that no ``__set_name__`` runs again.
    for attr in shadowed:
        value = next(_DICT(w)[attr] for w in chain if attr in _DICT(w))
        if isinstance(value, types.FunctionType):
            setattr(mirror, attr, _forwarder(chain, attr, value))
        else:
            setattr(mirror, attr, _WrapperAttr(chain, attr))
    try:
        # Python checks the layouts as for ``__class__``, and calls no hook.
        _bottom(mirror, chain).__bases__ = (base, chain[-1])
    except TypeError:
        return None
    return mirror


def _bottom(mirror: type, chain: tuple[type, ...]) -> type:
    """Return the mirror of the first class of ``chain`` (``FSDPModule``)."""
    for _ in chain[1:]:
        mirror = _BASES(mirror)[0]
    return mirror


def _forwarder(
    chain: tuple[type, ...], attr: str, method: types.FunctionType
) -> types.FunctionType:
    """
    Return a method that calls the wrapper classes' method ``attr`` as
    ``(wrapper_cls, cls)`` finds it at the time of the call: a replaced one, or
    the module's own where the wrapper classes no longer define it. A plain
    function, so that looking it up costs what looking up any method costs.
    """
    namespaces = tuple(_DICT(wrapper) for wrapper in chain)
    first = namespaces[0]

    def calls_wrapper_method(self: Any, /, *args: Any, **kwargs: Any) -> Any:
        value = first.get(attr, _MISSING)
        # The wrapper's own method: the usual case.
        if type(value) is types.FunctionType:
            return value(self, *args, **kwargs)
        for namespace in namespaces:
            value = namespace.get(attr, _MISSING)
            if value is not _MISSING:
                return _bound(value, self)(*args, **kwargs)
        return _beyond_wrappers(attr, self)(*args, **kwargs)

    return functools.wraps(method)(calls_wrapper_method)


class _WrapperAttr:
    """
    An attribute of the wrapper classes other than a method, in a mirror:
    looked up on them at each access, as ``(wrapper_cls, cls)`` finds it.
    """

    def __init__(self, chain: tuple[type, ...], attr: str) -> None:
        self.chain = chain
        self.attr = attr

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        for wrapper in self.chain:
            value = _DICT(wrapper).get(self.attr, _MISSING)
            if value is not _MISSING:
                return _bound(value, obj, objtype)
        return _beyond_wrappers(self.attr, obj, objtype)


def _bound(value: Any, obj: object, owner: type | None = None) -> Any:
    """Return ``value`` as an attribute of ``obj`` (or of ``owner``) finds it."""
    get = getattr(type(value), "__get__", None)
    owner = type(obj) if owner is None else owner
    return value if get is None else get(value, obj, owner)


def _beyond_wrappers(attr: str, obj: object, owner: type | None = None) -> Any:
    """
    Return ``attr`` of ``obj`` as the MRO finds it past the wrapper classes and
    their mirrors, where the wrapper classes no longer define it.
    """
    owner = type(obj) if owner is None else owner
    for cls in _MRO(owner):
        value = _DICT(cls).get(attr, _MISSING)
        forwarded = isinstance(value, _WrapperAttr) or (
            getattr(value, "__code__", None) is _FORWARDER_CODE
        )
        if value is not _MISSING and not forwarded:
            return _bound(value, obj, owner)
    raise AttributeError(f"type object {_NAME(owner)!r} has no attribute {attr!r}")


# The code every forwarder runs: the walk past the wrapper classes skips them.
_FORWARDER_CODE = next(
    const
    for const in _forwarder.__code__.co_consts
    if getattr(const, "co_name", None) == "calls_wrapper_method"
)
