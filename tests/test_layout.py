"""What the package keeps around the fix (``_layout``): the fix run as if torch's module defined
it, CPython's verdict for the status, the identity tables. Pure Python; the fix itself is
tests/test_wrapper_cls.py's."""

from __future__ import annotations

import abc
import gc
import sys
import types
import typing
from typing import Any

import pytest

from fsdp_autopatch import _layout, _wrapper_cls

T = typing.TypeVar("T")


class Module:
    pass


class Wrapper:
    _orig_cls_mro_index = 2


class ReplicateLike(Wrapper):
    _orig_cls_mro_index = 3


def test_the_fix_names_its_classes_as_type_called_in_torchs_module_does() -> None:
    """``type(...)`` names a class after the code that calls it, or ``abc`` where ABCMeta's own
    ``__new__`` is that code: run as if torch's module defined it, the fix names both alike."""
    class AbcLast(Module, abc.ABC):
        pass

    class AbcFirst(abc.ABC, Module):
        pass

    make = _layout.in_module(_wrapper_cls.make_wrapper_cls, "torch.distributed.made_up")
    torch_type = _layout.type_called_from("torch.distributed.made_up")
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
    assert _layout.parent_name(_layout.mirror_base(built, wrapper)) == (
        "abc.ABC" if first is abc.ABC else "typing.Generic")


def test_probe_instance_runs_no_code_and_keeps_its_class() -> None:
    class Counted(abc.ABC, Module):
        made = 0

        def __init__(self) -> None:
            Counted.made += 1

    instance = _layout._probe_instance(Counted)
    torchs = type("FSDPCounted", (Wrapper, Counted), {})
    assert type(instance) is Counted and Counted.made == 0
    accepted = _layout._swap_allowed(instance, torchs)
    assert type(instance) is Counted
    try:
        object.__new__(Counted).__class__ = torchs
    except TypeError:
        assert not accepted
    else:
        assert accepted


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


@pytest.mark.parametrize("wrapper", [Wrapper, ReplicateLike], ids=["wrapper", "replicate_like"])
def test_a_class_without_a_safe_probe_instance_is_judged_by_the_rule(
    wrapper: type, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``__del__`` would run on an uninitialised instance, so none is made: the rule decides,
    says so at debug level, and agrees with CPython as 3.9 - 3.14 state it (3.15 walks further)."""
    import logging

    assert _layout._probe_instance(Finalized) is None
    torchs = type("FSDPFinalized", (wrapper, Finalized), {})
    with caplog.at_level(logging.DEBUG, logger="fsdp_autopatch"):
        verdict = _layout.accepts(Finalized, torchs)
    gc.collect()
    assert Finalized.uninitialised_finalized == 0
    assert any("no instance of" in r.getMessage() for r in caplog.records)
    if sys.version_info < (3, 15):
        assert verdict is accepts_finalized(torchs) is False


class Key:
    def __eq__(self, other: object) -> bool:
        raise AssertionError("compared")

    __hash__ = object.__hash__


def test_identity_tables_never_compare_keys_and_let_them_go() -> None:
    table: _layout.ByIdentity[str] = _layout.ByIdentity()
    first, second = Key(), Key()
    table.set(first, "first")
    table.set(second, "second")
    assert table.get(first) == "first" and table.get(second) == "second" and len(table) == 2
    del first
    gc.collect()
    assert len(table) == 1

