"""CPython's ``__class__`` layout rule, and the wrapper classes built to obey it.

Pure Python: ``Wrapper`` and ``ReplicateLike`` stand in for torch's FSDPModule and
ReplicateModule (MRO index 2 and 3), ``Module`` for nn.Module. Every prediction is checked
against CPython itself, by assigning ``__class__`` on a real instance.
"""

from __future__ import annotations

import abc
import collections.abc
import typing

import pytest

from fsdp_autopatch import _layout

T = typing.TypeVar("T")


class Module:
    def _apply(self) -> tuple[str, ...]:
        return ("module",)


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


class Proto(typing.Protocol):
    def f(self) -> int: ...


class GenericModule(typing.Generic[T], Module):
    pass


class MappingModule(collections.abc.Mapping, Module):  # type: ignore[type-arg]
    def __getitem__(self, key: object) -> int:
        return 1

    def __iter__(self) -> typing.Iterator[object]:
        return iter(())

    def __len__(self) -> int:
        return 0


NEEDS_VARIANT = {
    "abc_first": type("AbcFirst", (abc.ABC, Module), {}),
    "abc_mixin": type("TokenHead", (GenericHead, Module), {}),
    "generic": GenericModule,
    "mapping": MappingModule,
}
UPSTREAM_WORKS = {
    "plain": type("Plain", (Module,), {}),
    "abc_last": type("AbcLast", (Module, abc.ABC), {}),
    "abcmeta_only": abc.ABCMeta("MetaOnly", (Module,), {}),
    "slots_mixin": type("SlotsMixin", (Slotted, Module), {}),
    "slots_then_abc": type("SlotsThenAbc", (abc.ABC, Slotted, Module), {}),
}
WRAPPERS = [Wrapper, ReplicateLike]


def cpython_accepts(cls: type, new: type) -> bool:
    instance = object.__new__(cls)
    try:
        instance.__class__ = new
    except TypeError:
        return False
    return True


def upstream(wrapper: type, cls: type) -> type:
    """What torch builds: ``type(f"FSDP{name}", (wrapper, cls), {"__deepcopy__": ...})``."""
    return type(f"FSDP{cls.__name__}", (wrapper, cls), {"__deepcopy__": None})


def build(wrapper: type, cls: type) -> type | None:
    return _layout.build_wrapper_class(
        _layout.WrapperMirrors(), wrapper, cls, f"FSDP{cls.__name__}", {"__deepcopy__": None}, __name__
    )


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("cls", [*NEEDS_VARIANT.values(), *UPSTREAM_WORKS.values()],
                         ids=[*NEEDS_VARIANT, *UPSTREAM_WORKS])
def test_predictions_match_cpython(wrapper: type, cls: type) -> None:
    accepted = cpython_accepts(cls, upstream(wrapper, cls))
    assert _layout.swap_accepted(cls, upstream(wrapper, cls)) is accepted
    assert (_layout.layout_parent_to_match(wrapper, cls) is None) is accepted
    assert accepted is (cls in UPSTREAM_WORKS.values())


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("cls", list(UPSTREAM_WORKS.values()), ids=list(UPSTREAM_WORKS))
def test_upstream_class_is_left_to_upstream(wrapper: type, cls: type) -> None:
    assert build(wrapper, cls) is None


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("cls", list(NEEDS_VARIANT.values()), ids=list(NEEDS_VARIANT))
def test_built_class_is_accepted_and_behaves_like_upstream(wrapper: type, cls: type) -> None:
    built = build(wrapper, cls)
    assert built is not None
    assert not cpython_accepts(cls, upstream(wrapper, cls)), "the bug must be there without the fix"
    assert cpython_accepts(cls, built)
    assert built.__name__ == f"FSDP{cls.__name__}"
    assert built.__module__ == upstream(wrapper, cls).__module__
    assert issubclass(built, wrapper) and issubclass(built, cls)
    assert type(built) is type(upstream(wrapper, cls))
    # torch finds the original class by index: 2 for FSDPModule, 3 for ReplicateModule.
    assert built.__mro__[wrapper._orig_cls_mro_index] is cls  # type: ignore[attr-defined]
    assert type(built.__new__(built)) is cls
    # The wrapper's own names resolve first, to the very same objects, as in upstream's MRO.
    for name in vars(wrapper):
        if not name.startswith("__") or name == "__new__":
            assert built.__dict__.get(name) is None and getattr(built, name) == getattr(wrapper, name)
    instance = object.__new__(cls)
    instance.__class__ = built
    assert instance._apply() == ("wrapper", "module")
    assert instance.reshard() == "reshard"
    assert "__deepcopy__" in built.__dict__


def test_mirrors_are_shared_per_layout_parent() -> None:
    mirrors = _layout.WrapperMirrors()
    first = _layout.build_wrapper_class(mirrors, Wrapper, NEEDS_VARIANT["abc_first"], "A", {}, __name__)
    second = _layout.build_wrapper_class(mirrors, Wrapper, NEEDS_VARIANT["abc_mixin"], "B", {}, __name__)
    assert first is not None and second is not None
    assert first.__bases__[0] is second.__bases__[0]
    assert mirrors.get(Wrapper, abc.ABC) is first.__bases__[0]


def test_protocol_parent_is_refused() -> None:
    cls = type("ProtocolModule", (type("Impl", (Proto,), {}), Module), {})
    assert not cpython_accepts(cls, upstream(Wrapper, cls))
    with pytest.raises(TypeError):
        build(Wrapper, cls)


def test_class_whose_super_target_would_be_skipped_is_refused() -> None:
    """Upstream's MRO runs the original class's ``_apply`` from FSDPModule's ``super()``; a
    built class would skip it, so none is built and torch fails as it always did."""

    class OwnApply(abc.ABC, Module):
        def _apply(self) -> tuple[str, ...]:
            return ("own", *super()._apply())

    with pytest.raises(TypeError, match="_apply"):
        build(Wrapper, OwnApply)
