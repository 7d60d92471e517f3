"""The wrapper classes built for CPython's ``__class__`` layout rule, checked against CPython itself.

Pure Python: ``Wrapper`` and ``ReplicateLike`` stand in for torch's FSDPModule and
ReplicateModule (MRO index 2 and 3), ``Module`` for nn.Module. Every expectation is taken from
CPython by assigning ``__class__`` on a real instance, here, independently of the package, so
the same tests hold on every Python: where this interpreter accepts torch's class for a shape,
the package must leave it to torch; where it refuses, the package must build one it accepts
(or refuse, and then torch fails as it always did).
"""

from __future__ import annotations

import abc
import collections.abc
import gc
import itertools
import logging
import types
import typing
from typing import Any, Optional, Union

import pytest

from fsdp_autopatch import _layout

T = typing.TypeVar("T")


class Module:
    def _apply(self) -> tuple[str, ...]:
        return ("module",)


class SlotsModule:
    """A module-like base without ``__dict__``."""

    __slots__ = ("weight",)


class Wrapper:
    _orig_cls_mro_index = 2

    def __new__(cls, *args: object, **kwargs: object) -> Wrapper:
        original = cls.__mro__[cls._orig_cls_mro_index]
        return original.__new__(original)  # type: ignore[no-any-return]

    def reshard(self) -> str:
        return "reshard"

    def _apply(self) -> tuple[str, ...]:
        return ("wrapper", *super()._apply())  # type: ignore[misc]


class ReplicateLike(Wrapper):
    _orig_cls_mro_index = 3


class GenericHead(abc.ABC):  # noqa: B024 (transformers' heads have no abstract methods either)
    """Like transformers 4.54's GenericForTokenClassification(ABC)."""


class Slotted:
    __slots__ = ("a",)


class EmptySlots:
    __slots__ = ()


class Proto(typing.Protocol):
    def f(self) -> int: ...


class ProtoImpl(Proto):
    def f(self) -> int:
        return 1


class Plain:
    pass


# Bases placed ahead of (or after) the module base: empty-__slots__ parents (ABC, Generic[T],
# Protocol, collections.abc), slotted and dict-carrying mixins.
MIXINS: dict[str, Any] = {
    "abc": abc.ABC,
    "abc_mixin": GenericHead,
    "generic": typing.Generic[T],
    "protocol": Proto,
    "protocol_impl": ProtoImpl,
    "sized": collections.abc.Sized,
    "mapping": collections.abc.Mapping,
    "hashable": collections.abc.Hashable,
    "slotted": Slotted,
    "empty_slots": EmptySlots,
    "plain": Plain,
}
MODULES = {"module": Module, "slots_module": SlotsModule}
OWN = {"dict": {}, "no_dict": {"__slots__": ()}, "slot": {"__slots__": ("x",)}}
WRAPPERS = [Wrapper, ReplicateLike]


def make_class(name: str, bases: tuple[Any, ...], namespace: dict[str, Any]) -> Optional[type]:
    """``class name(*bases)`` made concrete, or None where Python refuses the combination."""
    try:
        cls = types.new_class(name, bases, exec_body=lambda ns: ns.update(namespace))
    except TypeError:  # layout conflicts, inconsistent MROs, Protocol rules
        return None
    # A module class is always instantiable; lift abstractness left by collections.abc mixins.
    if getattr(cls, "__abstractmethods__", None):
        cls.__abstractmethods__ = frozenset()  # type: ignore[misc]
    return cls


def shapes() -> dict[str, type]:
    """Single and multiple inheritance of every mixin with both module bases, in both orders, with
    and without ``__dict__``, plus three-base mixes."""
    found: dict[str, type] = {}
    for (mixin, base), (module, module_base), (own, namespace) in itertools.product(
        MIXINS.items(), MODULES.items(), OWN.items()
    ):
        for order, bases in (("first", (base, module_base)), ("last", (module_base, base))):
            name = f"{mixin}_{order}_{module}_{own}"
            cls = make_class(name, bases, namespace)
            if cls is not None:
                found[name] = cls
    for first, second in itertools.permutations(["abc", "generic", "sized", "slotted", "plain"], 2):
        cls = make_class(f"{first}_{second}_module", (MIXINS[first], MIXINS[second], Module), {})
        if cls is not None:
            found[f"{first}_{second}_module"] = cls
    found["abcmeta_only"] = abc.ABCMeta("MetaOnly", (Module,), {})
    found["module"] = Module
    return found


SHAPES = shapes()


def cpython_accepts(cls: type, new: type) -> bool:
    instance = object.__new__(cls)
    try:
        instance.__class__ = new
    except TypeError:
        return False
    return True


def has_dict(cls: type) -> bool:
    return hasattr(object.__new__(cls), "__dict__")


def upstream(wrapper: type, cls: type) -> type:
    """What torch builds: ``type(f"FSDP{name}", (wrapper, cls), {"__deepcopy__": ...})``."""
    return type(f"FSDP{cls.__name__}", (wrapper, cls), {"__deepcopy__": None})


def choose(
    wrapper: type, cls: type, mirrors: Optional[_layout.WrapperMirrors] = None,
    torchs: Optional[type] = None,
) -> _layout.WrapperClass:
    """The package's choice for ``cls``, given torch's own class (built here as torch would)."""
    return _layout.wrapper_class(
        mirrors or _layout.WrapperMirrors(), wrapper, cls, f"FSDP{cls.__name__}",
        {"__deepcopy__": None}, __name__, torchs or upstream(wrapper, cls),
    )


def build(wrapper: type, cls: type, mirrors: Optional[_layout.WrapperMirrors] = None) -> Optional[type]:
    """The compatible class built for ``cls``; None where torch's own is used; TypeError (with
    the reason) where neither works."""
    chosen = choose(wrapper, cls, mirrors)
    if chosen.outcome == _layout.TORCH:
        return None
    if chosen.outcome == _layout.REFUSED:
        raise TypeError(chosen.reason)
    assert chosen.outcome == _layout.COMPATIBLE and chosen.parent is not None
    return chosen.cls


def outcome(wrapper: type, cls: type) -> Union[type, str, None]:
    try:
        return build(wrapper, cls)
    except TypeError:
        return "refused"


def test_the_shapes_are_broad() -> None:
    """Enough shapes, and on every Python both kinds: some CPython refuses (Generic[T] first,
    still refused on 3.15), some it accepts (no empty-__slots__ parent)."""
    assert len(SHAPES) > 60
    refused = [n for n, c in SHAPES.items() if not cpython_accepts(c, upstream(Wrapper, c))]
    assert "generic_first_module_dict" in refused
    assert "plain_first_module_dict" not in refused and "module" not in refused


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["wrapper", "replicate_like"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_decision_matches_cpython(wrapper: type, name: str) -> None:
    """torch's own class where CPython accepts it; else a class CPython accepts, or a refusal."""
    cls = SHAPES[name]
    result = outcome(wrapper, cls)
    if cpython_accepts(cls, upstream(wrapper, cls)):
        assert result is None
        return
    assert result is not None, "CPython refuses torch's class, so leaving it to torch keeps the bug"
    # Instances with a __dict__ can always take a mirror-based class; slots-only ones never can.
    assert (result != "refused") is has_dict(cls), result
    if result != "refused":
        assert isinstance(result, type) and cpython_accepts(cls, result)
        assert_behaves_like_upstream(wrapper, cls, result)


def assert_behaves_like_upstream(wrapper: type, cls: type, built: type) -> None:
    reference = upstream(wrapper, cls)
    assert built.__name__ == reference.__name__ and built.__module__ == reference.__module__
    assert issubclass(built, wrapper) and issubclass(built, cls)
    assert type(built) is type(reference)
    # torch finds the original class by index: 2 for FSDPModule, 3 for ReplicateModule.
    assert built.__mro__[wrapper._orig_cls_mro_index] is cls  # type: ignore[attr-defined]
    assert type(built.__new__(built)) is cls
    # The wrapper's own names resolve first, to the very same objects, as in upstream's MRO.
    for name in vars(wrapper):
        if not name.startswith("__") or name == "__new__":
            assert built.__dict__.get(name) is None and getattr(built, name) == getattr(wrapper, name)
    assert "__deepcopy__" in built.__dict__


# Shapes CPython refuses on every supported Python (3.15 included), and shapes whose fix the
# package makes wherever CPython refuses them.
ALWAYS_REFUSED = ["generic_first_module_dict", "generic_first_module_no_dict"]
FIXABLE_HERE = [
    name for name in ("abc_first_module_dict", "abc_mixin_first_module_dict", "sized_first_module_dict",
                      "mapping_first_module_dict", *ALWAYS_REFUSED)
    if not cpython_accepts(SHAPES[name], upstream(Wrapper, SHAPES[name]))
]


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["wrapper", "replicate_like"])
@pytest.mark.parametrize("name", FIXABLE_HERE)
def test_built_class_is_accepted_and_behaves_like_upstream(wrapper: type, name: str) -> None:
    cls = SHAPES[name]
    assert not cpython_accepts(cls, upstream(wrapper, cls)), "the bug must be there without the fix"
    built = build(wrapper, cls)
    assert built is not None and cpython_accepts(cls, built)
    assert_behaves_like_upstream(wrapper, cls, built)
    instance = object.__new__(cls)
    instance.__class__ = built
    assert instance._apply() == ("wrapper", "module")
    assert instance.reshard() == "reshard"


@pytest.mark.parametrize(
    "name", ["abc_first_module_dict", "sized_first_module_dict", "plain_first_module_dict"]
)
def test_torchs_own_class_is_left_where_cpython_accepts_it(name: str) -> None:
    """On 3.15 the ABC shapes join the plain one here: the package then stands aside."""
    cls = SHAPES[name]
    accepted = cpython_accepts(cls, upstream(Wrapper, cls))
    assert (build(Wrapper, cls) is None) is accepted


def test_mirrors_are_shared_per_layout_parent() -> None:
    mirrors = _layout.WrapperMirrors()
    name = ALWAYS_REFUSED[0]
    first = build(Wrapper, SHAPES[name], mirrors)
    second = build(Wrapper, make_class("Other", (typing.Generic[T], Module), {}), mirrors)  # type: ignore[arg-type]
    assert first is not None and second is not None
    assert first.__bases__[0] is second.__bases__[0]
    assert mirrors.get(Wrapper, typing.Generic) is first.__bases__[0]


def test_class_without_dict_is_refused_where_cpython_refuses_it() -> None:
    """Every wrapper class carries ``__dict__``; a slots-only original can never take one."""
    cls = SHAPES["generic_first_slots_module_slot"]
    assert not cpython_accepts(cls, upstream(Wrapper, cls))
    with pytest.raises(TypeError, match="has its layout"):
        build(Wrapper, cls)


class OwnApply(typing.Generic[T], Module):
    """A head whose ``_apply`` the wrapper's ``super()._apply()`` reaches in upstream's MRO."""

    def _apply(self) -> tuple[str, ...]:
        return ("own", *super()._apply())


def test_class_whose_super_target_would_be_skipped_is_refused() -> None:
    """Upstream's MRO runs the original class's ``_apply`` from FSDPModule's ``super()``; a
    built class would skip it, so none is built and torch fails as it always did."""
    assert not cpython_accepts(OwnApply, upstream(Wrapper, OwnApply))
    with pytest.raises(TypeError, match="_apply"):
        build(Wrapper, OwnApply)


class Finalized(typing.Generic[T], Module):
    uninitialised_finalized = 0

    def __del__(self) -> None:
        if not hasattr(self, "ready"):
            Finalized.uninitialised_finalized += 1


def accepts_finalized(new: type) -> bool:
    instance = object.__new__(Finalized)
    instance.ready = True  # type: ignore[attr-defined]
    try:
        instance.__class__ = new
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["wrapper", "replicate_like"])
def test_class_without_a_safe_probe_instance_is_judged_by_the_rule(
    wrapper: type, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``__del__`` would run on an uninitialised instance, so none is made: the rule decides,
    says so at debug level, and what it builds is still what CPython accepts."""
    assert _layout._probe_instance(Finalized) is None
    with caplog.at_level(logging.DEBUG, logger="fsdp_autopatch"):
        built = build(wrapper, Finalized)
    gc.collect()
    assert Finalized.uninitialised_finalized == 0
    assert any("no instance of" in r.getMessage() for r in caplog.records)
    if built is None:
        assert accepts_finalized(upstream(wrapper, Finalized))
    else:
        assert accepts_finalized(built)


def test_probe_instance_runs_no_code_and_keeps_its_class() -> None:
    class Counted(abc.ABC, Module):
        made = 0

        def __init__(self) -> None:
            Counted.made += 1

    instance = _layout._probe_instance(Counted)
    assert type(instance) is Counted and Counted.made == 0
    assert _layout._swap_allowed(instance, upstream(Wrapper, Counted)) is cpython_accepts(
        Counted, upstream(Wrapper, Counted))
    assert type(instance) is Counted


def test_layout_parents_follow_the_base_chain() -> None:
    cls = SHAPES["abc_mixin_first_module_dict"]
    assert _layout.layout_parents(cls) == [abc.ABC, GenericHead]
    assert _layout.layout_parents(Module) == []



class ReshardingWrapper:
    """A stand-in FSDPModule whose super()-calling method also uses names it does not look up on
    ``super()``: ``self.reshard`` and a global."""

    _orig_cls_mro_index = 2

    def reshard(self) -> str:
        return "reshard"

    def _apply(self) -> tuple[str, ...]:
        typing.cast(object, self.reshard())
        return ("wrapper", *super()._apply())  # type: ignore[misc]


class ReplicateOwnApply(Wrapper):
    """A stand-in ReplicateModule that overrides a method FSDPModule reaches with ``super()``."""

    _orig_cls_mro_index = 3

    def _apply(self) -> tuple[str, ...]:
        return ("replicate", *super()._apply())


def test_super_call_names_are_the_names_looked_up_on_super() -> None:
    class Calls(Module):
        def plain(self) -> tuple[str, ...]:
            return self._apply()

        def attribute_and_method(self) -> object:
            typing.cast(object, self.plain())
            return super()._apply(), super().__init__

        def stored(self) -> object:
            parent = super()
            return typing.cast(object, parent._apply())

    assert _layout.super_call_names(ReshardingWrapper) == {"_apply"}
    assert _layout.super_call_names(Wrapper) == {"_apply"}
    # A use of super() that is not ``super().name`` counts with every name the method uses.
    assert _layout.super_call_names(Calls) == {"_apply", "__init__", "super", "typing", "cast", "object"}
    only_followable = type("Followable", (Module,), {"f": Calls.attribute_and_method})
    assert _layout.super_call_names(only_followable) == {"_apply", "__init__"}


def assert_runs_like_upstream(wrapper: type, cls: type, built: type) -> None:
    """The built class answers ``_apply`` and ``reshard`` as torch's class would: compared with an
    instance made directly of torch's class (no ``__class__`` swap needed for that)."""
    instance = object.__new__(cls)
    instance.__class__ = built
    reference = object.__new__(upstream(wrapper, cls))
    assert instance._apply() == reference._apply()
    assert instance.reshard() == reference.reshard()


@pytest.mark.parametrize("wrapper", [ReshardingWrapper, ReplicateOwnApply], ids=["uses_reshard", "replicate"])
def test_head_that_only_shares_a_name_with_the_wrapper_gets_a_class(wrapper: type) -> None:
    """A head defining ``reshard`` (which FSDPModule's ``_apply`` calls on ``self``, not on
    ``super()``), and a two-class wrapper chain whose second class overrides what the first
    reaches with ``super()``: both MROs resolve alike, so a class is built."""

    class OwnReshard(typing.Generic[T], Module):
        def reshard(self) -> str:
            return "own reshard"

    cls = OwnReshard if wrapper is ReshardingWrapper else SHAPES[ALWAYS_REFUSED[0]]
    assert not cpython_accepts(cls, upstream(wrapper, cls)), "the bug must be there without the fix"
    built = build(wrapper, cls)
    assert built is not None and cpython_accepts(cls, built)
    assert built.__mro__[wrapper._orig_cls_mro_index] is cls  # type: ignore[attr-defined]
    assert_runs_like_upstream(wrapper, cls, built)


def test_replicate_chain_still_refuses_a_head_it_would_skip() -> None:
    """Upstream's ``super()._apply()`` from the wrapper chain reaches the head's ``_apply``;
    a built class would skip it, so none is built."""
    assert not cpython_accepts(OwnApply, upstream(ReplicateOwnApply, OwnApply))
    with pytest.raises(TypeError, match="OwnApply defines _apply"):
        build(ReplicateOwnApply, OwnApply)


def test_torchs_own_class_is_the_one_used_where_cpython_accepts_it() -> None:
    """Not a copy built again: the very class torch's call made, so that its construction
    (``__init_subclass__``, the metaclass) runs once, as without the patch."""
    cls = SHAPES["plain_first_module_dict"]
    torchs = upstream(Wrapper, cls)
    chosen = choose(Wrapper, cls, torchs=torchs)
    assert chosen.outcome == _layout.TORCH and chosen.cls is torchs


def test_compatible_class_construction_runs_the_hooks_once_more_for_that_class_only() -> None:
    """Where CPython refuses torch's class, the compatible class is a second construction of
    ``FSDP<Name>``: its ``__init_subclass__`` runs for it (documented), once."""
    made: list[str] = []

    class Registering(typing.Generic[T], Module):
        def __init_subclass__(cls, **kwargs: object) -> None:
            super().__init_subclass__(**kwargs)  # type: ignore[call-arg]
            made.append(cls.__name__)

    torchs = upstream(Wrapper, Registering)
    assert made == ["FSDPRegistering"]
    chosen = choose(Wrapper, Registering, torchs=torchs)
    assert chosen.outcome == _layout.COMPATIBLE and chosen.parent is typing.Generic
    assert made == ["FSDPRegistering", "FSDPRegistering"]


def test_a_class_whose_construction_hook_refuses_a_second_class_is_refused_not_raised() -> None:
    """A registry that refuses a second ``FSDP<Name>``: the compatible class cannot be built, so
    torch's own class is used and torch raises its usual layout error."""
    registry: set[str] = set()

    class Unique(typing.Generic[T], Module):
        def __init_subclass__(cls, **kwargs: object) -> None:
            super().__init_subclass__(**kwargs)  # type: ignore[call-arg]
            if cls.__name__ in registry:
                raise ValueError(f"duplicate registration {cls.__name__}")
            registry.add(cls.__name__)

    torchs = upstream(Wrapper, Unique)
    chosen = choose(Wrapper, Unique, torchs=torchs)
    assert chosen.outcome == _layout.REFUSED and chosen.cls is torchs
    assert chosen.reason == "ValueError: duplicate registration FSDPUnique"


class Described:
    """A data descriptor, as a wrapper might define one."""

    def __get__(self, instance: object, owner: Optional[type] = None) -> object:
        return self if instance is None else instance.__dict__.get("_described", "unset")

    def __set__(self, instance: object, value: object) -> None:
        instance.__dict__["_described"] = value


class LiveWrapper(Wrapper):
    _orig_cls_mro_index = 3
    described = Described()

    def unshard(self) -> str:
        return "unshard"


@pytest.mark.parametrize("wrapper", [Wrapper, LiveWrapper], ids=["wrapper", "two_class_chain"])
def test_monkeypatches_of_the_wrapper_reach_built_classes_as_they_reach_upstreams(wrapper: type) -> None:
    """Replaced, restored and deleted on the real wrapper class, before and after the class is
    built: the built class answers exactly as torch's own class does, on every step."""

    class OwnReshard(typing.Generic[T], Module):
        def reshard(self) -> str:
            return "own reshard"

    real = Wrapper.__dict__["reshard"]
    built = build(wrapper, OwnReshard)  # a head that defines a wrapper name, before any patch
    assert built is not None
    instance = object.__new__(OwnReshard)
    instance.__class__ = built
    reference = object.__new__(upstream(wrapper, OwnReshard))

    def answers(obj: object) -> object:
        try:
            return obj.reshard()  # type: ignore[attr-defined]
        except AttributeError as error:
            return type(error)

    def traced(self: object) -> str:
        return "traced"

    try:
        assert answers(instance) == answers(reference) == "reshard"
        Wrapper.reshard = traced  # type: ignore[method-assign]
        late = build(wrapper, make_class("Late", (typing.Generic[T], Module), {}))  # type: ignore[arg-type]
        late_instance = object.__new__(late.__mro__[wrapper._orig_cls_mro_index])  # type: ignore[union-attr,attr-defined]
        late_instance.__class__ = late
        assert answers(instance) == answers(reference) == answers(late_instance) == "traced"
        del Wrapper.reshard
        # Gone from the wrapper: upstream's MRO then finds the head's own method, and so does this.
        assert answers(instance) == answers(reference) == "own reshard"
        assert answers(late_instance) is AttributeError
        assert not hasattr(late, "reshard")
    finally:
        Wrapper.reshard = real  # type: ignore[method-assign]
    assert answers(instance) == answers(reference) == "reshard"


def test_data_descriptors_of_the_wrapper_stay_data_descriptors() -> None:
    cls = SHAPES[ALWAYS_REFUSED[0]]
    built = build(LiveWrapper, cls)
    assert built is not None
    instance = object.__new__(cls)
    instance.__class__ = built
    reference = object.__new__(upstream(LiveWrapper, cls))
    for obj in (instance, reference):
        assert obj.described == "unset"  # type: ignore[attr-defined]
        obj.described = "set"  # type: ignore[attr-defined]
        assert obj.described == "set" and obj.unshard() == "unshard"  # type: ignore[attr-defined]
    assert built.described is LiveWrapper.__dict__["described"]  # type: ignore[attr-defined]
