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
instance; the rule above is modelled (``_swap_accepted``) only for classes of which no such
instance can be made.

The fix builds, per layout parent ``P`` (``ABC``, ``Generic[T]``, a ``collections.abc`` mixin),
a mirror of the wrapper's class chain that sits on ``P``: ``FSDPModule'(P, FSDPModule)``. The
wrapper class for ``cls`` is then ``type(f"FSDP{name}", (FSDPModule', cls), ns)``: its layout
chain matches, it is still a subclass of ``FSDPModule``, and the original class keeps its MRO
index. The mirror is built on a private empty-slots class and then moved onto ``P`` by
``__bases__`` assignment, which runs no ``__init_subclass__`` and no metaclass: users' class
hooks run only for the class their modules get. It is held weakly, so it lives exactly as long
as the classes built on it.

Upstream's MRO puts ``FSDPModule`` before ``cls``; here ``cls`` (down to ``P``) comes before the
real ``FSDPModule``. For a name that both that head of ``cls`` and the wrapper's chain define
(rare: ``_apply`` where ``nn.Module`` sits before ``P``), the mirror holds a stand-in that looks
the name up on the real classes at each access, so a monkeypatch of ``FSDPModule`` reaches these
modules as it reaches upstream's. Every other name resolves on the real classes by the MRO
itself, to the very functions upstream's class finds (which ``torch.compile`` traces alike).

Pure Python; no torch here.
"""

from __future__ import annotations

import builtins
import dis
import logging
import types
import typing
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

# CPython type flags (Include/object.h), stable since 3.0.
_HAVE_GC = 1 << 14
_LAYOUT_ATTRIBUTES = ("__basicsize__", "__itemsize__", "__dictoffset__", "__weakrefoffset__")
# What type() and the class statement make for every class (3.13 adds __firstlineno__ and
# __static_attributes__, 3.14 the lazy annotations): metadata of the class itself, not names its
# instances look up, so a mirror neither stands in for them nor copies them.
_CLASS_METADATA = frozenset(
    {"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "__slots__",
     "__abstractmethods__", "_abc_impl", "__orig_bases__", "__parameters__", "__annotations__",
     "__annotate__", "__annotate_func__", "__annotations_cache__", "__firstlineno__",
     "__static_attributes__"}
)

# What became of an original class at a construction site.
TORCH = "torch"  # CPython accepts torch's own class: that very class is used
COMPATIBLE = "compatible"  # CPython refuses torch's class; a layout-compatible one is used
REFUSED = "refused"  # CPython refuses torch's class and no compatible one can be built

_GENERIC_PARAMETER = typing.TypeVar("_GENERIC_PARAMETER")
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


def index_of(sequence: tuple[type, ...], item: type) -> int:
    """``sequence.index(item)`` by identity: ``index`` compares with ``==``, a metaclass's."""
    return next(position for position, each in enumerate(sequence) if each is item)


def _adds_nothing(cls: type) -> bool:
    """CPython's ``compatible_with_tp_base``: ``cls`` has its base's instance layout."""
    base = cls.__base__
    if base is None:
        return False
    same_sizes = all(getattr(cls, name) == getattr(base, name) for name in _LAYOUT_ATTRIBUTES)
    return same_sizes and (cls.__flags__ & _HAVE_GC) == (base.__flags__ & _HAVE_GC)


def _layout_root(cls: type) -> type:
    """The class where CPython's layout walk stops: the one that last changed the layout."""
    while _adds_nothing(cls):
        cls = cls.__base__  # type: ignore[assignment]
    return cls


def _own_slots(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    names = (slots,) if isinstance(slots, str) else tuple(slots)
    return tuple(name for name in names if name not in ("__dict__", "__weakref__"))


def _swap_accepted(old: type, new: type) -> bool:
    """Would CPython accept ``instance_of_old.__class__ = new``? (``compatible_for_assignment``)"""
    old_root, new_root = _layout_root(old), _layout_root(new)
    if old_root is new_root:
        return True
    return (
        old_root.__base__ is new_root.__base__
        and old_root.__basicsize__ == new_root.__basicsize__
        and _own_slots(old_root) == _own_slots(new_root)
    )


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


# Per wrapper class (torch's), what super_call_names found: disassembled once, not per class built.
_super_names: ByIdentity[tuple[tuple[Any, ...], frozenset[str]]] = ByIdentity()


def super_call_names(cls: type) -> frozenset[str]:
    """Names that ``cls``'s own methods look up through zero-argument ``super()``.

    A method that uses ``super`` in a way that cannot be followed counts with every name it
    uses, so the answer errs towards refusing. Kept per class while its methods are the same
    (a monkeypatch of the wrapper replaces a function, and the answer is found again).
    """
    functions = tuple(function for value in cls.__dict__.values() for function in _functions(value)
                      if "__class__" in function.__code__.co_freevars)
    codes = tuple(function.__code__ for function in functions)
    known = _super_names.get(cls)
    if known is not None and len(known[0]) == len(codes) and all(a is b for a, b in zip(known[0], codes)):
        return known[1]
    names: set[str] = set()
    for code in codes:
        looked_up = _super_attributes(code)
        names.update(code.co_names if looked_up is None else looked_up)
    _super_names.set(cls, (codes, frozenset(names)))
    return frozenset(names)


def _bind(value: Any, instance: Any, owner: type) -> Any:
    """``value`` as attribute lookup returns it from a class dict: through its ``__get__``."""
    get = getattr(type(value), "__get__", None)
    return value if get is None else get(value, instance, owner)


class WrapperAttribute:
    """A name of the wrapper's chain, in a mirror: looked up on the real classes at each access.

    Upstream resolves the name on the first class of the wrapper's chain that has it, then
    (once a monkeypatch deleted it there) on the rest of the MRO; so does this.
    """

    __slots__ = ("chain", "name")

    def __init__(self, chain: tuple[type, ...], name: str) -> None:
        self.chain = chain  # the real wrapper's MRO, without ``object``
        self.name = name

    def _find(self, owner: type) -> tuple[bool, Any]:
        for cls in self.chain:
            if self.name in cls.__dict__:
                return True, cls.__dict__[self.name]
        for cls in owner.__mro__:  # the mirrors themselves hold stand-ins, not values
            value = cls.__dict__.get(self.name, self)
            if value is not self and not isinstance(value, WrapperAttribute):
                return True, value
        return False, None

    def __get__(self, instance: Any, owner: Optional[type] = None) -> Any:
        owner = type(instance) if owner is None else owner
        found, value = self._find(owner)
        if not found:
            raise AttributeError(f"type object {owner.__name__!r} has no attribute {self.name!r}")
        return _bind(value, instance, owner)

    def __repr__(self) -> str:
        return f"<attribute {self.name!r} of {self.chain[0].__qualname__}, looked up at access>"


class WrapperDataAttribute(WrapperAttribute):
    """The same for a data descriptor (a property): it also takes precedence over the instance
    ``__dict__`` and handles assignment and deletion, as the descriptor it stands in for does."""

    __slots__ = ()

    def _descriptor(self, instance: Any, method: str) -> Any:
        found, value = self._find(type(instance))
        handler = getattr(type(value), method, None) if found else None
        if handler is None:
            raise AttributeError(f"{type(instance).__name__!r} object attribute {self.name!r} is read-only")
        return handler, value

    def __set__(self, instance: Any, new: Any) -> None:
        handler, value = self._descriptor(instance, "__set__")
        handler(value, instance, new)

    def __delete__(self, instance: Any) -> None:
        handler, value = self._descriptor(instance, "__delete__")
        handler(value, instance)


def _stand_in(chain: tuple[type, ...], name: str) -> WrapperAttribute:
    value = next(cls.__dict__[name] for cls in chain if name in cls.__dict__)
    data = hasattr(type(value), "__set__") or hasattr(type(value), "__delete__")
    return (WrapperDataAttribute if data else WrapperAttribute)(chain, name)


def _mirror_class(original: type, base: type, shadowed: frozenset[str]) -> type:
    """A class named as ``original``, with bases ``(base, original)``, holding a stand-in for
    each ``shadowed`` name of ``original``'s chain, so that those names resolve before the
    original class's own (as upstream's MRO has them) and always to what the real classes hold
    now."""
    chain = original.__mro__[:-1]  # without object
    names = {name for cls in chain for name in cls.__dict__} & shadowed

    def fill(namespace: dict[str, Any]) -> None:
        namespace.update((name, _stand_in(chain, name)) for name in sorted(names))
        namespace["__module__"] = original.__module__
        namespace["__qualname__"] = original.__qualname__
        namespace["__doc__"] = original.__doc__

    return types.new_class(original.__name__, (base, original), exec_body=fill)


class _Detached:
    """Where a mirror chain is built before it moves onto its layout parent: empty slots on
    ``object``, as the parents are, and no class hooks."""

    __slots__ = ()


def shadowed_names(wrapper: type, cls: type, parent: type) -> frozenset[str]:
    """The names of the wrapper's chain that a class of ``cls``'s MRO placed before the real
    wrapper (``cls`` down to ``parent``, and ``parent``'s own bases) also defines: only these
    need a stand-in in the mirror. Errs towards more names, which are always correct."""
    mro = cls.__mro__
    head = [c for c in (*mro[: index_of(mro, parent) + 1], *parent.__mro__) if c is not object]
    wrapper_names = {name for c in wrapper.__mro__[:-1] for name in c.__dict__} - _CLASS_METADATA
    return frozenset(name for name in wrapper_names if any(name in c.__dict__ for c in head))


class WrapperMirrors:
    """Per (wrapper, layout parent, shadowed names), the mirror of the wrapper's class chain
    sitting on that parent, shared by every class built on it while one lives."""

    def __init__(self) -> None:
        # Weak: a mirror lives as long as the classes built on it. Keyed by identity: a live
        # mirror holds its wrapper and parent, so neither id can be reused while the entry exists.
        self._mirrors: weakref.WeakValueDictionary[tuple[int, int, frozenset[str]], type] = \
            weakref.WeakValueDictionary()

    def get(self, wrapper: type, parent: type, shadowed: frozenset[str] = frozenset()) -> type:
        key = (id(wrapper), id(parent), shadowed)
        mirror = self._mirrors.get(key)
        if mirror is None:
            mirror = self._build(wrapper, parent, shadowed)
            mirror = self._mirrors.setdefault(key, mirror)
        return mirror

    @staticmethod
    def _build(wrapper: type, parent: type, shadowed: frozenset[str]) -> type:
        chain = [c for c in reversed(wrapper.__mro__) if c is not object]
        if any(len(c.__bases__) != 1 for c in chain):
            raise TypeError(f"{wrapper.__qualname__} has multiple bases; cannot mirror it")
        mirror: type = _Detached
        bottom: Optional[type] = None
        for original in chain:
            mirror = _mirror_class(original, mirror, shadowed)
            bottom = bottom or mirror
        assert bottom is not None
        try:
            # CPython checks the layouts as for __class__, recomputes the MROs of the whole chain,
            # and calls no hook of the parent's.
            bottom.__bases__ = (parent, chain[0])
        except TypeError:
            # A parent whose layout the private base does not share: built on it directly, so
            # the parent's own class hooks run for the mirror too.
            mirror = parent if parent is not typing.Generic else typing.Generic[_GENERIC_PARAMETER]  # type: ignore[assignment]
            for original in chain:
                mirror = _mirror_class(original, mirror, shadowed)
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


def parent_name(parent: type) -> str:
    """``abc.ABC``, ``typing.Generic``: how a layout parent is named in the status and the log."""
    return f"{parent.__module__}.{parent.__qualname__}"


@dataclass(frozen=True)
class WrapperClass:
    """The class a site uses for one original class, and why."""

    cls: type  # torch's own class (TORCH, REFUSED) or the layout-compatible one (COMPATIBLE)
    outcome: str
    parent: Optional[type] = None  # COMPATIBLE: the layout parent its mirror sits on
    reason: str = ""  # REFUSED: why no compatible class could be built


def acceptance(cls: type) -> Callable[[type], bool]:
    """A test of whether CPython accepts a class swap for instances of ``cls``: tried on an
    uninitialised instance, or, for classes of which none can be made safely, judged by the rule
    (``_swap_accepted``)."""
    instance = _probe_instance(cls)
    if instance is not None:
        return lambda new: _swap_allowed(instance, new)
    logger.debug("no instance of %s can be made to ask CPython; judging its layout by the rule "
                 "as CPython 3.9-3.14 state it", cls.__qualname__)
    return lambda new: _swap_accepted(cls, new)


def wrapper_class(
    mirrors: WrapperMirrors, wrapper: type, cls: type, name: str, namespace: dict[str, Any],
    module_name: str, upstream: type,
) -> WrapperClass:
    """The class to use for ``cls``: ``upstream`` (torch's own ``type(name, (wrapper, cls),
    namespace)``, built by the caller with the very call torch makes) where CPython accepts it,
    so that its ``__init_subclass__`` and metaclass run once, as without the patch; else a class
    built in ``module_name`` on a mirror of the wrapper chain that CPython accepts (a second
    construction, for this class only); else ``upstream`` again, REFUSED, with the reason.
    """
    accepted = acceptance(cls)
    if accepted(upstream):
        return WrapperClass(upstream, TORCH)
    build = type_called_from(module_name)
    try:
        parent, compatible = _compatible_class(mirrors, wrapper, cls, name, namespace, build, accepted)
    except Exception as error:  # the layout, or what the class's own construction hooks raised
        reason = str(error) if isinstance(error, TypeError) else f"{type(error).__name__}: {error}"
        return WrapperClass(upstream, REFUSED, reason=reason)
    return WrapperClass(compatible, COMPATIBLE, parent)


def _compatible_class(
    mirrors: WrapperMirrors, wrapper: type, cls: type, name: str, namespace: dict[str, Any],
    build: Callable[..., Any], accepted: Callable[[type], bool],
) -> tuple[type, type]:
    """The first class built on a mirror of a base of ``cls`` that CPython accepts; raises
    TypeError when none is (e.g. a class without ``__dict__``: every wrapper class adds one)."""
    failures = []
    for parent in layout_parents(cls):
        try:
            mirror = mirrors.get(wrapper, parent, shadowed_names(wrapper, cls, parent))
            new_cls = build(name, (mirror, cls), dict(namespace))
        except TypeError as error:  # no consistent MRO, a parent that cannot be subclassed so,
            # or the class's own __init_subclass__ or metaclass refusing a second FSDP<Name>
            failures.append(f"on {parent_name(parent)}: {type(error).__name__}: {error}")
            continue
        if accepted(new_cls):
            _check_super_calls(new_cls, wrapper, cls)
            return parent, new_cls
    tried = f" (building it {'; '.join(failures)})" if failures else ""
    raise TypeError(f"no class built on a base of {cls.__qualname__} has its layout{tried}")


def _check_super_calls(new_cls: type, wrapper: type, cls: type) -> None:
    """Refuse a class in which ``super()`` from a wrapper method would skip the original's code.

    In the built MRO the original class's head (``cls`` down to the layout parent) sits between
    the mirrors and the real wrapper classes; upstream puts it right after the wrapper's chain.
    A ``super().name`` in a wrapper class that upstream would resolve in that head resolves
    past it here, unless a later class of the wrapper's own chain defines ``name`` (then both
    MROs find it there first).
    """
    mro = new_cls.__mro__
    head = mro[index_of(mro, cls) : index_of(mro, wrapper)]
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
