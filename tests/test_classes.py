"""What the package keeps around the fix (``_classes``): the fix called as if from torch's module,
CPython's verdict for the status, the identity tables. Pure Python; the fix itself is
tests/test_wrapper_cls.py's."""

from __future__ import annotations

import abc
import gc
import sys
import types
import typing
from typing import Any

import pytest
from harness import cpython_accepts

from fsdp_autopatch import _classes, _wrapper_cls

T = typing.TypeVar("T")


class Module:
    pass


class Wrapper:
    _orig_cls_mro_index = 2


class ReplicateLike(Wrapper):
    _orig_cls_mro_index = 3


def test_the_fix_names_its_classes_as_type_called_in_torchs_module_does() -> None:
    """``type(...)`` names a class after the code that calls it, or ``abc`` where ABCMeta's own
    ``__new__`` is that code: called as if from torch's module, the fix names both alike."""
    class AbcLast(Module, abc.ABC):
        pass

    class AbcFirst(abc.ABC, Module):
        pass

    make = _classes.called_from("torch.distributed.made_up", _wrapper_cls.make_wrapper_cls)
    torch_type = _classes.called_from("torch.distributed.made_up", type)
    for cls in (Module, AbcLast, AbcFirst):
        torchs = torch_type(f"FSDP{cls.__name__}", (Wrapper, cls), {})
        assert make(f"FSDP{cls.__name__}", (Wrapper, cls), {}).__module__ == torchs.__module__
    assert make("FSDPModule", (Wrapper, Module), {}).__module__ == "torch.distributed.made_up"
    assert make("FSDPAbcLast", (Wrapper, AbcLast), {}).__module__ == "abc"


@pytest.mark.parametrize("wrapper", [Wrapper, ReplicateLike])
@pytest.mark.parametrize("first", [abc.ABC, typing.Generic[T]], ids=["abc", "generic"])
def test_mirror_base_names_where_the_mirror_sits(wrapper: type, first: Any) -> None:
    head = types.new_class("Head", (first, Module))
    built = _wrapper_cls.make_wrapper_cls("FSDPHead", (wrapper, head), {})
    if built.__bases__[0] is wrapper:
        pytest.skip("this CPython accepts torch's class here (3.15: the ABC case)")
    assert _classes.parent_name(_classes.mirror_base(built, wrapper)) == (
        "abc.ABC" if first is abc.ABC else "typing.Generic")


class Finalized(Module):
    """A module base whose instances count their own code: an instance made to ask CPython would
    run ``__del__`` (on an uninitialised module)."""

    calls = 0

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        Finalized.calls += 1
        return super().__new__(cls)

    def __init__(self) -> None:
        Finalized.calls += 1

    def __del__(self) -> None:
        Finalized.calls += 1


@pytest.mark.parametrize("wrapper", [Wrapper, ReplicateLike], ids=["wrapper", "replicate_like"])
@pytest.mark.parametrize("first", [abc.ABC, typing.Generic[T], None], ids=["abc", "generic", "plain"])
def test_cpythons_verdict_on_torchs_class_runs_no_code_of_the_users_classes(
    wrapper: type, first: Any
) -> None:
    """The status's verdict is CPython's, asked of an instance of torch's wrapper class, never of
    the user's: a ``__del__``, ``__new__`` or ``__init__`` of theirs never runs for it."""
    cls = types.new_class("Head", (first, Finalized) if first is not None else (Finalized,))
    torchs = type(f"FSDP{cls.__name__}", (wrapper, cls), {})
    expected = cpython_accepts(cls, torchs)
    gc.collect()
    Finalized.calls = 0
    assert _classes.accepts(cls, torchs) is expected
    gc.collect()
    assert Finalized.calls == 0
    assert expected is (first is None or (first is abc.ABC and sys.version_info >= (3, 15)))


class Key:
    def __eq__(self, other: object) -> bool:
        raise AssertionError("compared")

    __hash__ = object.__hash__


def test_identity_tables_never_compare_keys_and_let_them_go() -> None:
    table: _classes.ByIdentity[str] = _classes.ByIdentity()
    first, second = Key(), Key()
    table.set(first, "first")
    table.set(second, "second")
    assert table.get(first) == "first" and table.get(second) == "second" and len(table) == 2
    del first
    gc.collect()
    assert len(table) == 1

