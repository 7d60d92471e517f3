"""The layout fix: a wrapper class CPython accepts in ``obj.__class__ = new``, found by asking it.

``fully_shard`` swaps a module's class for ``type(f"FSDP{name}", (FSDPModule, cls), ns)``.
CPython (``compatible_for_assignment`` in Objects/typeobject.c) accepts the swap only when both
classes have the same *layout chain*. On 3.9 - 3.14: follow ``__base__`` while a class adds
nothing to the instance layout; the class where each walk stops must be the same, or both must
sit on the same ``__base__`` and add the same slots. ``class Head(ABC, nn.Module)`` adds
``__dict__`` on top of ``ABC`` (empty ``__slots__``) while ``FSDPModule`` adds it on top of
``object``, so the walks end on different bases and the swap is refused. 3.15 walks further
(it accepts the ABC case, not a ``Generic[T]`` one), and every version compares flags a model
in Python would miss. So each decision here is CPython's own answer on an uninitialised
instance; the rule above is modelled (``swap_accepted``) only for classes of which no such
instance can be made.

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
import dis
import logging
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

logger = logging.getLogger("fsdp_autopatch")


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


# Instructions that sit between ``super`` and its call or attribute without changing what is
# looked up (3.11's PRECALL and PUSH_NULL, inline caches, padding).
_TRANSPARENT_OPS = frozenset({"CACHE", "EXTENDED_ARG", "NOP", "PRECALL", "PUSH_NULL"})
_CALL_OPS = frozenset({"CALL", "CALL_FUNCTION"})
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
# LOAD_SUPER_ATTR (3.12+): this bit of its argument marks ``super(cls, obj)`` with two arguments.
_TWO_ARGUMENT_SUPER = 2


def _super_attributes(code: types.CodeType) -> Optional[set[str]]:
    """The attribute names ``code`` looks up as ``super().name``; None when ``super`` is used in
    any other way (two arguments, stored, passed on), which cannot be followed from here.

    3.12+ compiles ``super().name`` to LOAD_SUPER_ATTR; before, and on 3.12+ when that
    specialisation does not apply, it is LOAD_GLOBAL super, a call with no arguments, then
    LOAD_ATTR or LOAD_METHOD.
    """
    instructions = [i for i in dis.get_instructions(code) if i.opname not in _TRANSPARENT_OPS]
    names: set[str] = set()
    super_loads = 0
    for index, instruction in enumerate(instructions):
        if instruction.opname == "LOAD_SUPER_ATTR":
            if instruction.arg is None or instruction.arg & _TWO_ARGUMENT_SUPER:
                return None
            names.add(instruction.argval)
            super_loads -= 1  # its LOAD_GLOBAL super was counted below
        elif instruction.opname == "LOAD_GLOBAL" and instruction.argval == "super":
            super_loads += 1
            call, attribute = [*instructions[index + 1 : index + 3], None, None][:2]
            if (call is not None and call.opname in _CALL_OPS and call.arg == 0
                    and attribute is not None and attribute.opname in _ATTRIBUTE_OPS):
                names.add(attribute.argval)
                super_loads -= 1
        elif instruction.opname in ("LOAD_NAME", "LOAD_DEREF", "LOAD_FAST") and instruction.argval == "super":
            return None
    return names if super_loads == 0 else None


def super_call_names(cls: type) -> set[str]:
    """Names that ``cls``'s own methods look up through zero-argument ``super()``.

    A method that uses ``super`` in a way that cannot be followed counts with every name it
    uses, so the answer errs towards refusing.
    """
    names: set[str] = set()
    for value in cls.__dict__.values():
        for function in _functions(value):
            code = function.__code__
            if "__class__" in code.co_freevars:
                looked_up = _super_attributes(code)
                names.update(code.co_names if looked_up is None else looked_up)
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


# object's own ``__class__`` setter: CPython's check itself, whatever ``__setattr__`` or
# ``__class__`` property the classes define (nn.Module's __setattr__ ends in it too).
_SET_CLASS = object.__dict__["__class__"].__set__


def probe_instance(cls: type) -> Optional[object]:
    """An uninitialised instance of ``cls`` to try class swaps on, or None where none can be made
    safely: ``object.__new__`` refuses abstract classes and classes whose C base has its own
    ``__new__``, and a ``__del__`` would later run on the uninitialised instance."""
    if getattr(cls, "__del__", None) is not None:
        return None
    try:
        return object.__new__(cls)
    except TypeError:
        return None


def swap_allowed(instance: object, new: type) -> bool:
    """Does CPython accept ``instance.__class__ = new``? The instance keeps its class."""
    old = type(instance)
    try:
        _SET_CLASS(instance, new)
    except TypeError:
        return False
    _SET_CLASS(instance, old)  # the check is symmetric: what went one way goes back
    return True


def layout_parents(cls: type) -> list[type]:
    """Bases a wrapper mirror may sit on, nearest to ``object`` first: CPython compares the
    classes on the ``__base__`` chains, so the parent that matches is on ``cls``'s chain."""
    chain = []
    base = cls.__base__
    while base is not None and base is not object:
        chain.append(base)
        base = base.__base__
    return chain[::-1]


def build_wrapper_class(
    mirrors: WrapperMirrors, wrapper: type, cls: type, name: str, namespace: dict[str, Any],
    module_name: str,
) -> Optional[type]:
    """The class upstream should have built for ``cls`` in ``module_name``, or None where
    CPython accepts upstream's own.

    CPython is asked: upstream's class (same name, bases, namespace and ``__module__``) is
    tried on an uninitialised instance of ``cls``, and so is each candidate built on a mirror
    of the wrapper chain. Raises TypeError when no candidate is accepted (e.g. a class
    without ``__dict__``: every wrapper class adds one).
    """
    build = type_called_from(module_name)
    instance = probe_instance(cls)
    if instance is None:
        logger.debug("no instance of %s can be made to ask CPython; judging its layout by the "
                     "rule as CPython 3.9-3.14 state it", cls.__qualname__)
        return _build_by_rule(mirrors, wrapper, cls, name, namespace, build)
    if swap_allowed(instance, build(name, (wrapper, cls), dict(namespace))):
        return None
    for parent in layout_parents(cls):
        try:
            new_cls = build(name, (mirrors.get(wrapper, parent), cls), dict(namespace))
        except TypeError:  # no consistent MRO, or a parent that cannot be subclassed so
            continue
        if swap_allowed(instance, new_cls):
            _check_super_calls(new_cls, wrapper, cls)
            return new_cls
    raise TypeError(f"no class built on a base of {cls.__qualname__} has its layout")


def _build_by_rule(
    mirrors: WrapperMirrors, wrapper: type, cls: type, name: str, namespace: dict[str, Any],
    build: Callable[..., Any],
) -> Optional[type]:
    parent = layout_parent_to_match(wrapper, cls)
    if parent is None:
        return None
    new_cls = build(name, (mirrors.get(wrapper, parent), cls), dict(namespace))
    if not swap_accepted(cls, new_cls):
        raise TypeError(f"built {name} but its layout still differs from {cls.__qualname__}")
    _check_super_calls(new_cls, wrapper, cls)
    return new_cls


def _check_super_calls(new_cls: type, wrapper: type, cls: type) -> None:
    """Refuse a class in which ``super()`` from a wrapper method would skip the original's code.

    In the built MRO the original class's head (``cls`` down to the layout parent) sits between
    the mirrors and the real wrapper classes; upstream puts it right after the wrapper's chain.
    A ``super().name`` in a wrapper class that upstream would resolve in that head resolves
    past it here, unless a later class of the wrapper's own chain defines ``name`` (then both
    MROs find it there first).
    """
    mro = new_cls.__mro__
    head = mro[mro.index(cls) : mro.index(wrapper)]
    chain = wrapper.__mro__[:-1]
    for position, real in enumerate(chain):
        later = chain[position + 1 :]
        for name in super_call_names(real):
            if any(name in c.__dict__ for c in later):
                continue
            for between in head:
                if name in between.__dict__:
                    raise TypeError(
                        f"{between.__qualname__} defines {name}, which "
                        f"{real.__qualname__}'s super() call would skip in {new_cls.__name__}"
                    )
