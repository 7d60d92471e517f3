"""The parts of ``_patch`` that need no torch: the list of classes the status shows, and the
stand-in for ``type`` that the patch puts in a torch module, driven here by a stand-in wrapper.
The sites themselves are exercised on real torch in test_fully_shard.py, test_hooks.py and
test_replicate.py."""

from __future__ import annotations

import abc
import sys
import threading
import types
import typing
from typing import Any

import pytest

from fsdp_autopatch import _layout, _patch, _sites


def record(index: int) -> _patch.ClassRecord:
    return _patch.ClassRecord(f"Block{index}", "user.model", "site", f"FSDPBlock{index}", "torch")


def test_class_records_keep_the_first_ones_and_count_all_from_many_threads() -> None:
    records = _patch.ClassRecords(limit=10)
    start = threading.Barrier(8)

    def add(thread: int) -> None:
        start.wait()
        for index in range(100):
            records.add(record(thread * 100 + index))

    threads = [threading.Thread(target=add, args=(thread,)) for thread in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept, seen = records.snapshot()
    assert seen == 800 and len(kept) == 10 and len(set(kept)) == 10


class Wrapper:
    """Stands in for FSDPModule: a plain class that adds ``__dict__`` on top of ``object``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        original = cls.__mro__[2]
        return original.__new__(original)


class Plain:
    pass


class Head(abc.ABC, Plain):  # the layout of transformers 4.54 - 4.55.2's heads
    pass


T = typing.TypeVar("T")


class GenericHead(typing.Generic[T], Plain):  # refused by every CPython, 3.15 included
    pass


def deepcopy(*args: Any) -> None:
    raise AssertionError("not deep-copied in these tests")


@pytest.fixture
def stand_in() -> Any:
    """A stand-in for ``type`` in a throwaway module, serving ``Wrapper`` as a site would."""
    module = types.ModuleType("torch_stand_in")
    sys.modules[module.__name__] = module
    site = _sites.Site("stand-in API", module.__name__, "wrap", ("Wrapper",), "W", "deepcopy")
    construction = _patch.Construction(site, Wrapper, deepcopy, module, None)
    _patch.install(construction)
    yield module.type
    _patch.uninstall(construction)
    assert "type" not in module.__dict__, "uninstalling leaves the module with the builtin type"
    del sys.modules[module.__name__]


def test_the_stand_in_is_the_builtin_for_every_other_call(stand_in: Any) -> None:
    assert stand_in(3) is int and stand_in("x") is str
    made = stand_in("Other", (Plain,), {"x": 1})
    assert isinstance(made, type) and made.__bases__ == (Plain,) and made.__module__ == "torch_stand_in"
    # A call of the site's shape whose name is not the prefix's is not the site's either.
    assert stand_in("Other", (Wrapper, Head), {}).__name__ == "Other"


def test_the_stand_in_answers_isinstance_issubclass_and_attributes_as_type(stand_in: Any) -> None:
    assert isinstance(Plain, stand_in) and not isinstance(Plain(), stand_in)
    assert issubclass(abc.ABCMeta, stand_in) and not issubclass(int, stand_in)
    assert stand_in.__name__ == "type" and stand_in.mro(int) == [int, object]
    assert stand_in.__wrapped__ is type


def test_plain_classes_get_torchs_class_built_per_call_as_torch_builds_it(stand_in: Any) -> None:
    first = stand_in("WPlain", (Wrapper, Plain), {"__deepcopy__": deepcopy})
    second = stand_in("WPlain", (Wrapper, Plain), {"__deepcopy__": deepcopy})
    assert first is not second, "one new class per call, as the builtin type makes"
    for built in (first, second):
        assert built.__bases__ == (Wrapper, Plain) and built.__module__ == "torch_stand_in"


def refused(cls: type, new: type) -> bool:
    """Does CPython refuse ``instance_of_cls.__class__ = new``? (Asked on an instance.)"""
    try:
        object.__new__(cls).__class__ = new
    except TypeError as error:
        assert "object layout differs" in str(error)
        return True
    return False


@pytest.mark.parametrize(("cls", "parent"), [(Head, "abc.ABC"), (GenericHead, "typing.Generic")])
def test_a_class_cpython_refuses_gets_one_compatible_class_that_it_accepts(cls: type, parent: str) -> None:
    name = f"W{cls.__name__}"
    module = types.ModuleType(f"torch_stand_in_{cls.__name__}")
    upstream = _layout.type_called_from(module.__name__)(name, (Wrapper, cls), {})  # as torch builds it
    sys.modules[module.__name__] = module
    site = _sites.Site("stand-in API", module.__name__, "wrap", ("Wrapper",), "W", "deepcopy")
    construction = _patch.Construction(site, Wrapper, deepcopy, module, None)
    _patch.install(construction)
    try:
        stand_in_call = module.type
        built = stand_in_call(name, (Wrapper, cls), {"__deepcopy__": deepcopy})
        if not refused(cls, upstream):
            # This CPython accepts torch's class (3.15 and the ABC case): the stand-in stands aside.
            assert built.__bases__ == (Wrapper, cls)
            return
        assert stand_in_call(name, (Wrapper, cls), {"__deepcopy__": deepcopy}) is built
        instance = object.__new__(cls)
        instance.__class__ = built
        assert isinstance(instance, Wrapper) and isinstance(instance, cls) and built.__mro__[2] is cls
        # Named after torch's module, or after ABCMeta's, whose own __new__ calls type's, as torch's is.
        assert built.__name__ == name and built.__module__ == upstream.__module__
        (kept,) = [r for r in _patch.classes.snapshot()[0] if r.name == cls.__qualname__]
        site_name = f"{module.__name__}.wrap"
        assert (kept.outcome, kept.parent, kept.site) == (_layout.COMPATIBLE, parent, site_name)
    finally:
        _patch.uninstall(construction)
        del sys.modules[module.__name__]


INLINE_BUILDER = '''
class Wrapper:
    pass


def deepcopy(*args):
    raise AssertionError("not deep-copied")


def wrap(module):
    return wrap_impl(module)


def wrap_impl(module):
    cls = module.__class__
    module.__class__ = type(f"W{cls.__name__}", (Wrapper, cls), {"__deepcopy__": deepcopy})
    return module
'''


def test_a_builder_in_the_entrys_own_module_builds_inline_not_as_a_shared_helper() -> None:
    """FSDP2 replicate on torch 2.9 and 2.10 builds its class in ``replicate_impl``, beside
    ``replicate``: the self-check and the probe must run that construction inline, not call the
    builder with torch 2.11's shared helper's arguments."""
    module = types.ModuleType("torch_inline_stand_in")
    exec(INLINE_BUILDER, module.__dict__)
    sys.modules[module.__name__] = module
    try:
        inline = _sites.Site("stand-in API", module.__name__, "wrap", ("Wrapper",), "W", "deepcopy",
                             builder=(module.__name__, "wrap_impl"))
        construction = _patch.resolve(inline)
        assert construction is not None and construction.helper is None
        shared = _sites.Site("stand-in API", module.__name__, "wrap", ("Wrapper",), "W", "deepcopy",
                             builder=("torch_helper_stand_in", "wrap_impl"))
        helper_module = types.ModuleType("torch_helper_stand_in")
        exec(INLINE_BUILDER, helper_module.__dict__)
        sys.modules[helper_module.__name__] = helper_module
        construction = _patch.resolve(shared)
        assert construction is not None and construction.helper is module.wrap_impl
    finally:
        sys.modules.pop(module.__name__, None)
        sys.modules.pop("torch_helper_stand_in", None)
