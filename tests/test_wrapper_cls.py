"""The layout fix, ``_wrapper_cls.make_wrapper_cls``, checked against CPython itself.

Pure Python: ``Wrapper`` and ``ReplicateLike`` stand in for torch's FSDPModule and ReplicateModule
(MRO index 2 and 3), ``Module`` for nn.Module. Every expectation is taken from CPython by
assigning ``__class__`` on a real instance, here, independently of the function, so the same
tests hold on every Python: where this interpreter accepts torch's class for a shape, the
function builds exactly that class; where it refuses, one it accepts (or torch's, for a class
without ``__dict__``, and then torch fails as it always did). The function is called from
this module, as torch's builder calls it, and names the classes it builds after this module, as
``type(...)`` called here names them.
"""

from __future__ import annotations

import abc
import collections.abc
import gc
import inspect
import itertools
import os
import pickle
import signal
import subprocess
import sys
import threading
import types
import typing
import warnings
import weakref
from pathlib import Path
from typing import Any, Optional

import pytest
from harness import cpython_accepts

from fsdp_autopatch import _wrapper_cls

T = typing.TypeVar("T")
make_wrapper_cls = _wrapper_cls.make_wrapper_cls
ROOT = Path(__file__).resolve().parent.parent


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
    "typing_sized": typing.Sized,
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
    and without ``__dict__``, three-base mixes, and a subclass of an ABC-first class."""
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
    found["subclass_of_abc_first"] = make_class("SubclassOfAbcFirst", (found["abc_first_module_dict"],), {})  # type: ignore[assignment]
    found["abcmeta_only"] = abc.ABCMeta("MetaOnly", (Module,), {})
    found["module"] = Module
    return found


SHAPES = shapes()


def has_dict(cls: type) -> bool:
    return hasattr(object.__new__(cls), "__dict__")


def upstream(wrapper: type, cls: type) -> type:
    """What torch builds: ``type(f"FSDP{name}", (wrapper, cls), {"__deepcopy__": ...})``."""
    return type(f"FSDP{cls.__name__}", (wrapper, cls), {"__deepcopy__": None})


def make(wrapper: type, cls: type) -> type:
    """What torch builds with the fix: the same call, to ``make_wrapper_cls``."""
    return make_wrapper_cls(f"FSDP{cls.__name__}", (wrapper, cls), {"__deepcopy__": None})


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
    """torch's own class where CPython accepts it; else a class CPython accepts where the
    module's instances have ``__dict__`` (every wrapper class adds one), else torch's again."""
    cls = SHAPES[name]
    built = make(wrapper, cls)
    if cpython_accepts(cls, upstream(wrapper, cls)) or not has_dict(cls):
        assert_is_torchs_class(built, upstream(wrapper, cls))
        return
    assert built.__bases__[0] is not wrapper, "CPython refuses torch's class: that keeps the bug"
    assert cpython_accepts(cls, built)
    assert_behaves_like_upstream(wrapper, cls, built)


def assert_is_torchs_class(built: type, reference: type) -> None:
    """``built`` is the class ``type(...)`` builds in torch's place: the same bases, metaclass,
    names (``__module__`` included: this module's, or ``abc`` where ABCMeta's ``__new__`` calls
    ``type``) and namespace."""
    assert built.__bases__ == reference.__bases__ and type(built) is type(reference)
    assert (built.__name__, built.__qualname__, built.__module__) == (
        reference.__name__, reference.__qualname__, reference.__module__)
    assert set(vars(built)) == set(vars(reference))
    assert vars(built)["__deepcopy__"] is vars(reference)["__deepcopy__"]


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
    instance = object.__new__(cls)
    instance.__class__ = built
    assert instance._apply() == object.__new__(reference)._apply()
    assert instance.reshard() == "reshard"


# Shapes CPython refuses on every supported Python (3.15 included).
ALWAYS_REFUSED = "generic_first_module_dict"


@pytest.mark.parametrize(
    "name", ["abc_first_module_dict", "sized_first_module_dict", "plain_first_module_dict"]
)
def test_torchs_own_class_is_built_where_cpython_accepts_it(name: str) -> None:
    """On 3.15 the ABC shapes join the plain one here: the fix then stands aside."""
    cls = SHAPES[name]
    assert (make(Wrapper, cls).__bases__ == (Wrapper, cls)) is cpython_accepts(cls, upstream(Wrapper, cls))


def counting(made: list[str]) -> tuple[type, type]:
    """A module base whose ``__init_subclass__`` and metaclass list each class made from it."""

    class Counting(abc.ABCMeta):
        def __new__(meta, name: str, bases: tuple[type, ...], namespace: dict[str, Any],
                    **kwargs: Any) -> Any:
            made.append(f"metaclass {name}")
            return super().__new__(meta, name, bases, namespace, **kwargs)

    class Counted(Module, metaclass=Counting):
        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            made.append(cls.__name__)

    return Counted, Counting


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["wrapper", "replicate_like"])
@pytest.mark.parametrize("first", [abc.ABC, typing.Generic[T], collections.abc.Sized, EmptySlots],
                         ids=["abc", "generic", "sized", "empty_slots"])
def test_one_class_per_call_for_an_empty_slots_first_module_as_for_a_plain_one(
    wrapper: type, first: Any
) -> None:
    """The module's hooks see one class per call, its own, whether it needs the fix or not; no
    other class of the module's hierarchy is made (never torch's first and then another)."""
    made: list[str] = []
    counted, _ = counting(made)
    head = make_class("Head", (first, counted), {})
    twin = make_class("Twin", (counted,), {})
    assert head is not None and twin is not None
    for cls in (head, twin):
        made.clear()
        built = make(wrapper, cls)
        assert made == [f"metaclass FSDP{cls.__name__}", f"FSDP{cls.__name__}"]
        assert cls.__subclasses__() == [built]
        del built
        gc.collect()


def test_mirrors_tell_themselves_apart_in_an_mro_and_a_pickle_error() -> None:
    cls = SHAPES[ALWAYS_REFUSED]
    built = make(ReplicateLike, cls)
    names = [c.__qualname__ for c in built.__mro__]
    assert names.count("Wrapper") == names.count("ReplicateLike") == 1
    assert names[1:3] == ["GenericReplicateLike", "GenericWrapper"]
    with pytest.raises((pickle.PicklingError, AttributeError), match="GenericReplicateLike"):
        pickle.dumps(built.__mro__[1])


def test_mirrors_are_shared_per_base_and_go_with_the_classes_built_on_them() -> None:
    first = make(Wrapper, SHAPES[ALWAYS_REFUSED])
    second = make(Wrapper, make_class("Other", (typing.Generic[T], Module), {}))  # type: ignore[arg-type]
    assert first.__bases__[0] is second.__bases__[0]
    mirror = weakref.ref(first.__bases__[0])
    del first, second
    gc.collect()
    assert mirror() is None


def test_every_class_built_can_die() -> None:
    refs = []
    for _ in range(5):
        cls = make_class("Made", (abc.ABC, Module), {})
        assert cls is not None
        refs += [weakref.ref(cls), weakref.ref(make(Wrapper, cls))]
        del cls
    gc.collect()
    assert not any(ref() for ref in refs)


def test_a_class_without_dict_keeps_torchs_class() -> None:
    """Every wrapper class carries ``__dict__``; a slots-only original can never take one."""
    cls = SHAPES["generic_first_slots_module_slot"]
    assert not cpython_accepts(cls, upstream(Wrapper, cls))
    assert make(Wrapper, cls).__bases__ == (Wrapper, cls)


class OwnApply(typing.Generic[T], Module):
    """A head whose ``_apply`` the wrapper's ``super()._apply()`` reaches in upstream's MRO."""

    def _apply(self) -> tuple[str, ...]:
        return ("own", *super()._apply())


class ReplicateOwnApply(Wrapper):
    """A stand-in ReplicateModule that overrides a method FSDPModule reaches with ``super()``."""

    _orig_cls_mro_index = 3

    def _apply(self) -> tuple[str, ...]:
        return ("replicate", *super()._apply())


@pytest.mark.parametrize("wrapper", [Wrapper, ReplicateOwnApply], ids=["wrapper", "replicate"])
def test_a_head_whose_method_the_wrappers_super_reaches_keeps_torchs_class(wrapper: type) -> None:
    """Upstream's MRO runs the original class's ``_apply`` from the wrapper's ``super()``; a
    mirror would skip it, so none is built and torch fails as it always did."""
    assert not cpython_accepts(OwnApply, upstream(wrapper, OwnApply))
    assert make(wrapper, OwnApply).__bases__ == (wrapper, OwnApply)


class ReshardingWrapper:
    """A stand-in FSDPModule whose super()-calling method also calls a method on ``self``."""

    _orig_cls_mro_index = 2

    def reshard(self) -> str:
        return "reshard"

    def _apply(self) -> tuple[str, ...]:
        typing.cast(object, self.reshard())
        return ("wrapper", *super()._apply())  # type: ignore[misc]


class OwnReshard(typing.Generic[T], Module):
    def reshard(self) -> str:
        return "own reshard"


def test_a_head_that_only_shares_a_name_with_the_wrapper_gets_a_class() -> None:
    """A head defining ``reshard``, which the wrapper calls on ``self``: the mirror resolves it
    to the wrapper's, as upstream's MRO does."""
    assert not cpython_accepts(OwnReshard, upstream(ReshardingWrapper, OwnReshard))
    built = make(ReshardingWrapper, OwnReshard)
    assert built.__bases__[0] is not ReshardingWrapper and cpython_accepts(OwnReshard, built)
    instance = object.__new__(OwnReshard)
    instance.__class__ = built
    reference = object.__new__(upstream(ReshardingWrapper, OwnReshard))
    assert instance._apply() == reference._apply() and instance.reshard() == reference.reshard() == "reshard"


class EmptyGeneric(typing.Generic[T]):
    __slots__ = ()


class OwnReshardGeneric(typing.Generic[T], Module):
    def reshard(self) -> str:
        return "own reshard"


class OtherReshard(typing.Generic[T]):
    def reshard(self) -> str:
        return "other reshard"


# Shapes whose new MRO puts more of the module's classes than those up to the mirror's base ahead
# of the wrapper: a mixin ahead of a class with its own method; another generic class with a
# method of the wrapper's ahead of it; the module base ahead of it (whose _apply the wrapper's
# reaches with super(): no mirror can keep that order). Generic-first, which every CPython refuses.
AHEAD = {
    "mixin_ahead_of_an_own_method": ((EmptyGeneric, OwnReshardGeneric), True),
    "another_generic_ahead": ((EmptyGeneric, OtherReshard, Module), True),
    "module_base_ahead": ((EmptyGeneric, Module, OtherReshard), False),
}


@pytest.mark.parametrize("name", list(AHEAD))
def test_every_class_the_new_mro_puts_ahead_of_the_wrapper_is_reckoned_with(name: str) -> None:
    """The wrapper's names resolve as in torch's MRO, through every class ahead of the wrapper in
    the class built, not only those up to the mirror's base; where one of them defines a name
    the wrapper reaches with ``super()`` (``_apply``), no mirror is built and torch raises."""
    bases, mirrored = AHEAD[name]
    cls = make_class(name, bases, {})
    assert cls is not None and not cpython_accepts(cls, upstream(ReshardingWrapper, cls))
    built = make(ReshardingWrapper, cls)
    assert (built.__bases__[0] is not ReshardingWrapper) is mirrored
    if mirrored:
        instance = object.__new__(cls)
        instance.__class__ = built
        reference = object.__new__(upstream(ReshardingWrapper, cls))  # torch's class, CPython aside
        assert instance.reshard() == reference.reshard() == "reshard"
        assert instance._apply() == reference._apply()


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


def test_data_descriptors_of_the_wrapper_stay_data_descriptors() -> None:
    cls = SHAPES[ALWAYS_REFUSED]
    built = make(LiveWrapper, cls)
    instance = object.__new__(cls)
    instance.__class__ = built
    reference = object.__new__(upstream(LiveWrapper, cls))
    for obj in (instance, reference):
        assert obj.described == "unset"  # type: ignore[attr-defined]
        obj.described = "set"  # type: ignore[attr-defined]
        assert obj.described == "set" and obj.unshard() == "unshard"  # type: ignore[attr-defined]
    assert built.described is LiveWrapper.__dict__["described"]  # type: ignore[attr-defined]


def test_a_head_that_shadows_a_data_descriptor_of_the_wrapper_keeps_torchs_class() -> None:
    """A mirror's stand-in is no data descriptor: it would lose to the instance ``__dict__``."""
    cls = make_class("OwnDescribed", (typing.Generic[T], Module), {"described": "own"})
    assert cls is not None
    assert make(LiveWrapper, cls).__bases__ == (LiveWrapper, cls)


@pytest.mark.parametrize("wrapper", [Wrapper, LiveWrapper], ids=["wrapper", "two_class_chain"])
def test_monkeypatches_of_the_wrapper_reach_built_classes_as_they_reach_upstreams(wrapper: type) -> None:
    """Replaced, restored and deleted on the real wrapper class, before and after the class is
    built: the built class answers exactly as torch's own class does, on every step."""
    real = Wrapper.__dict__["reshard"]
    built = make(wrapper, OwnReshard)  # a head that defines a wrapper name, before any patch
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
        late = make(wrapper, make_class("Late", (typing.Generic[T], Module), {}))  # type: ignore[arg-type]
        late_instance = object.__new__(late.__mro__[wrapper._orig_cls_mro_index])  # type: ignore[attr-defined]
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


def test_a_wrapper_attribute_mocked_while_a_class_is_built_is_the_wrappers_again_after_the_mock() -> None:
    """A mock of the wrapper's method in place when a module's class that shadows it is wrapped
    (and its mirror built) stays a mock only while it is in place, for that class and the next."""
    from unittest import mock

    with mock.patch.object(Wrapper, "reshard", return_value="mocked"):
        during = make(Wrapper, OwnReshard)
        instance = object.__new__(OwnReshard)
        instance.__class__ = during
        assert instance.reshard() == "mocked"
    later = make(Wrapper, make_class("LaterOwnReshard", (typing.Generic[T], Module),
                                     {"reshard": OwnReshard.reshard}))  # type: ignore[arg-type]
    late_instance = object.__new__(later.__mro__[2])
    late_instance.__class__ = later
    reference = object.__new__(upstream(Wrapper, OwnReshard))
    assert instance.reshard() == late_instance.reshard() == reference.reshard() == "reshard"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX's")
def test_a_child_forked_while_another_thread_builds_a_mirror_builds_its_own() -> None:
    """The mirrors' lock, held by another thread at fork(), is a new one in the child."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _wrapper_cls._mirrors_lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() with threads
            pid = os.fork()
        if pid == 0:  # the child: exit 0 once a mirror is built
            base = make_class("ForkedBase", (typing.Generic[T],), {"__slots__": ()})
            built = make(Wrapper, make_class("ForkedHead", (base, Module), {}))  # type: ignore[arg-type]
            os._exit(0 if built.__bases__[0] is not Wrapper else 1)
        ended: list[int] = []
        waiter = threading.Thread(target=lambda: ended.append(os.waitpid(pid, 0)[1]), daemon=True)
        waiter.start()
        waiter.join(timeout=60)
        if not ended:
            os.kill(pid, signal.SIGKILL)
            waiter.join()
        assert ended and os.waitstatus_to_exitcode(ended[0]) == 0, "the child hung on the mirrors' lock"
    finally:
        release.set()
        holder.join()


class ByName(abc.ABCMeta):
    """Classes equal whatever they are; comparing them at all is the bug this finds."""

    def __eq__(cls, other: object) -> bool:
        raise AssertionError(f"{cls.__name__} compared with {other!r}")

    __hash__ = abc.ABCMeta.__hash__


def test_classes_are_compared_by_identity_never_by_a_metaclass_eq() -> None:
    head = ByName("Head", (abc.ABC, Module), {})
    twin = ByName("Twin", (Module,), {})
    for cls in (head, twin):
        built = make(Wrapper, cls)
        assert built.__mro__[2] is cls and cpython_accepts(cls, built)


def test_no_module_is_touched_to_decide() -> None:
    """The function takes classes, never a module: CPython is asked of new instances of torch's
    wrapper and of the mirror, which no one else sees."""
    import inspect

    assert list(inspect.signature(_wrapper_cls.make_wrapper_cls).parameters) == ["name", "bases", "namespace"]


@pytest.mark.parametrize("first", [abc.ABC, typing.Generic[T]], ids=["abc", "generic"])
def test_a_plain_or_abc_last_module_gets_the_class_torch_builds_named_as_torch_names_it(first: Any) -> None:
    """torch's own ``type(...)`` names its class after torch's module, or ``abc`` for an ABCMeta
    class; the fix, called there, names it the same (tests/test_upstream.py: in torch itself)."""
    last = make_class("Last", (Module, first), {})
    assert last is not None
    for cls in (Module, last):
        assert_is_torchs_class(make(Wrapper, cls), upstream(Wrapper, cls))
    assert make(Wrapper, Module).__module__ == __name__
    assert make(Wrapper, abc.ABCMeta("Meta", (Module,), {})).__module__ == "abc"


class Calls(collections.Counter):  # type: ignore[type-arg]
    """What code of a module's classes ran, by name."""


def own_code(calls: Calls, own_mro: bool = False) -> tuple[type, type]:
    """A metaclass and an empty-``__slots__`` mixin that count every call of their code: the
    methods ``type(...)`` may run for a class, every attribute read through the metaclass, and
    what an instance may meet; ``own_mro``: the metaclass makes MROs itself."""

    class Counting(abc.ABCMeta):
        def __getattribute__(cls, name: str) -> Any:
            calls["metaclass __getattribute__"] += 1
            return super().__getattribute__(name)

        def __new__(meta, name: str, bases: tuple[type, ...], namespace: dict[str, Any],
                    **kwargs: Any) -> Any:
            calls["metaclass __new__"] += 1
            return super().__new__(meta, name, bases, namespace, **kwargs)

        def __init__(cls, *args: Any, **kwargs: Any) -> None:
            calls["metaclass __init__"] += 1
            super().__init__(*args, **kwargs)

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            calls["metaclass __call__"] += 1
            return super().__call__(*args, **kwargs)

    if own_mro:
        def mro(cls: type) -> list[type]:
            calls["metaclass mro"] += 1
            return abc.ABCMeta.mro(cls)

        Counting.mro = mro  # type: ignore[method-assign]

    class Named:
        def __set_name__(self, owner: type, name: str) -> None:
            calls["__set_name__"] += 1

    class Mixin(metaclass=Counting):
        __slots__ = ()
        named = Named()

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            calls["__new__"] += 1
            return super().__new__(cls)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls["__init__"] += 1

        def __del__(self) -> None:
            calls["__del__"] += 1

        def __init_subclass__(cls, **kwargs: Any) -> None:
            calls["__init_subclass__"] += 1
            super().__init_subclass__(**kwargs)

    return Counting, Mixin


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=["wrapper", "replicate_like"])
@pytest.mark.parametrize("order", ["first", "last"])
@pytest.mark.parametrize("own_mro", [False, True], ids=["type_mro", "own_mro"])
def test_no_code_of_the_modules_classes_runs_beyond_what_type_runs(
    wrapper: type, order: str, own_mro: bool
) -> None:
    """Deciding and building the mirror run nothing of the module's classes, on any object: per
    call, exactly what torch's own ``type(...)`` call runs for the same class (its metaclass's
    ``__new__``, ``__init__``, ``mro`` and attribute reads, the ``__init_subclass__`` of the class
    built). The copy of the mirror's layout that CPython is asked with goes as a class of the
    fix's, so a ``__del__`` never sees it. A metaclass that makes MROs itself gets no mirror: the
    fix cannot foresee where it would put the wrapper's names, and torch raises as before."""
    calls = Calls()
    _, mixin = own_code(calls, own_mro)
    bases = (mixin, Module) if order == "first" else (Module, mixin)
    cls = types.new_class(f"Own{order.title()}", bases)
    made = cls()
    del made
    gc.collect()
    calls.clear()
    reference = upstream(wrapper, cls)
    torchs = Calls(calls)
    for _ in range(3):
        calls.clear()
        built = make(wrapper, cls)
        gc.collect()
        assert calls == torchs, f"beyond torch's own type() call: {calls - torchs}"
    assert {name: count for name, count in torchs.items() if "__getattribute__" not in name} == {
        "metaclass __new__": 1, "metaclass __init__": 1, "__init_subclass__": 1,
        **({"metaclass mro": 1} if own_mro else {})}
    assert (built.__bases__[0] is wrapper) is (cpython_accepts(cls, reference) or own_mro)


def test_one_mirror_per_wrapper_and_base_when_threads_build_at_once() -> None:
    """Eight threads build wrapper classes at the same instant for eight classes on one base, in
    30 trials: every class gets the one mirror of that base."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for trial in range(30):
            base = make_class(f"Base{trial}", (typing.Generic[T],), {"__slots__": ()})
            heads = [make_class(f"Head{index}", (base, Module), {}) for index in range(8)]
            barrier = threading.Barrier(len(heads))
            mirrors: list[type] = []

            def build(head: type, barrier: threading.Barrier = barrier,
                      mirrors: list[type] = mirrors) -> None:
                barrier.wait()
                mirrors.append(make(Wrapper, head).__bases__[0])

            threads = [threading.Thread(target=build, args=(head,)) for head in heads]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert len(mirrors) == 8 and len({id(mirror) for mirror in mirrors}) == 1, f"trial {trial}"
    finally:
        sys.setswitchinterval(interval)


def test_a_mirror_is_seen_from_outside_as_the_description_says() -> None:
    """What a user or a registry walking ``__subclasses__()`` observes of a mirror, pinned
    (upstream/README.md, docs/how-it-works.md): it is a subclass of its base and of the wrapper
    class, listed by both for as long as a class built on it lives; its metaclass is the wrapper
    class's, not the base's; no hook of the base ever saw it, since announcing it would run the
    module's code a second time. The class torch asks for is announced as always."""
    calls = Calls()
    counting, mixin = own_code(calls)
    cls = types.new_class("Head", (typing.Generic[T], mixin, Module))
    calls.clear()
    built = make(Wrapper, cls)
    mirror = built.__bases__[0]
    assert mirror is not Wrapper
    assert type(mirror) is type(Wrapper) is type and type(built) is counting
    assert mirror in typing.Generic.__subclasses__() and mirror in Wrapper.__subclasses__()
    assert built in mirror.__subclasses__() and built in cls.__subclasses__()
    assert calls["__init_subclass__"] == 1 and calls["metaclass __new__"] == 1  # for built alone
    reference = weakref.ref(mirror)
    del built, mirror
    gc.collect()
    assert reference() is None
    assert not any(sub.__qualname__ == "GenericWrapper" for sub in Wrapper.__subclasses__())


# Which __bases__ assignments audit hooks (PEP 578) saw, while one is being looked for.
AUDITED: list[str] = []
_auditing = threading.local()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if getattr(_auditing, "on", False) and event == "object.__setattr__" and args[1] == "__bases__":
        AUDITED.append(args[0].__qualname__)


def test_audit_hooks_see_the_mirrors_layout_and_the_mirror_move_and_nothing_for_a_plain_module() -> None:
    """The fix moves classes of its own with ``__bases__``: audit hooks see a copy of the mirror's
    layout move onto the base and back, and the mirror move onto it (upstream/README.md)."""
    sys.addaudithook(_audit)  # it stays for the process: it records only while asked
    _auditing.on = True
    try:
        AUDITED.clear()
        make(Wrapper, Module)
        assert AUDITED == []
        make(Wrapper, make_class("AuditedHead", (typing.Generic[T], Module), {}))  # type: ignore[arg-type]
    finally:
        _auditing.on = False
    # The mirror moves where it is built, not where an earlier test's is still alive; on 3.15 the
    # copy tries a second start.
    assert set(AUDITED) <= {"_MirrorLayout", "GenericWrapper"} and AUDITED.count("_MirrorLayout") >= 2


def test_a_shadowed_method_is_a_plain_method_on_the_built_class() -> None:
    """Where the module's class defines a method the wrapper class defines too, the mirror holds a
    method that calls the wrapper's: looked up as fast as any method (benchmarks/), found by
    ``inspect.getattr_static`` as a function, named and documented as the wrapper's."""
    built = make(ReshardingWrapper, OwnReshard)
    instance = object.__new__(OwnReshard)
    instance.__class__ = built
    found = inspect.getattr_static(instance, "reshard")
    assert isinstance(found, types.FunctionType)
    assert found.__wrapped__ is ReshardingWrapper.__dict__["reshard"]  # type: ignore[attr-defined]
    assert (found.__name__, found.__qualname__) == ("reshard", "ReshardingWrapper.reshard")
    assert instance.reshard() == "reshard" and instance.reshard.__self__ is instance


def test_torch_patch_adds_this_module_character_for_character() -> None:
    """upstream/torch.diff is what upstream/make_diff.py writes from fsdp_autopatch/_wrapper_cls.py."""
    generator = ROOT / "upstream" / "make_diff.py"
    if not generator.is_file():
        pytest.skip("upstream/ is not here (an installed wheel's tests): the checkout has it")
    result = subprocess.run([sys.executable, str(generator), "--check"], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    patch = (ROOT / "upstream" / "torch.diff").read_text(encoding="utf-8")
    added = [line[1:] for line in _new_file_hunk(patch)]
    source = (ROOT / "fsdp_autopatch" / "_wrapper_cls.py").read_text(encoding="utf-8")
    assert "".join(added) == source


def _new_file_hunk(patch: str) -> list[str]:
    lines = patch.splitlines(keepends=True)
    start = lines.index("+++ b/torch/distributed/_wrapper_cls.py\n") + 2
    hunk = []
    for line in lines[start:]:
        if not line.startswith("+"):
            break
        hunk.append(line)
    return hunk
