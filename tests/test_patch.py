"""The parts of ``_patch`` that need no torch: the list of classes the status shows, and the
builder's code redirected to the stand-in for ``type``, driven here in a module built like
torch's sites (tests/programs/site_stand_in.py), each against the same module unpatched.
The sites themselves are exercised on real torch in test_fully_shard.py, test_hooks.py and
test_replicate.py."""

from __future__ import annotations

import abc
import gc
import importlib.util
import inspect
import os
import sys
import threading
import types
import typing
import weakref
from typing import Any, Iterator

import pytest
from conftest import PROGRAMS

from fsdp_autopatch import _classes, _patch, _sites


def record(index: int) -> _classes.ClassRecord:
    return _classes.ClassRecord(f"Block{index}", "user.model", "site", f"FSDPBlock{index}", "torch")


def test_class_records_keep_the_first_ones_and_count_all_from_many_threads() -> None:
    records = _classes.ClassRecords(limit=10)
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


class Plain:
    pass


class Head(abc.ABC, Plain):  # the layout of transformers 4.54 - 4.55.2's heads
    pass


T = typing.TypeVar("T")


class GenericHead(typing.Generic[T], Plain):  # refused by every CPython, 3.15 included
    pass


STAND_IN_SOURCE = PROGRAMS / "site_stand_in.py"


def load(name: str) -> types.ModuleType:
    """A fresh copy of tests/programs/site_stand_in.py, imported as ``name``."""
    spec = importlib.util.spec_from_file_location(name, STAND_IN_SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def reload(module: types.ModuleType) -> None:
    """What ``importlib.reload`` does: the module's code run again in the same module object."""
    spec = module.__spec__
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(module)


def site_of(module: types.ModuleType) -> _sites.Site:
    return _sites.Site("stand-in API", (0,), module.__name__, "wrap", ("Wrapper",), "W", "deepcopy")


@pytest.fixture
def torch_like(request: pytest.FixtureRequest) -> Iterator[types.ModuleType]:
    """A module built like torch's sites, loaded afresh and removed after the test."""
    name = f"torch_stand_in_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    module = load(name)
    yield module
    sys.modules.pop(name, None)


@pytest.fixture
def patched(torch_like: types.ModuleType) -> Iterator[_patch.Construction]:
    """The patch installed at the stand-in module's site, and uninstalled after the test."""
    code = torch_like.wrap.__code__
    construction = _patch.resolve(site_of(torch_like))
    assert construction is not None
    _patch.install(construction)
    yield construction
    _patch.uninstall(construction)
    # (A test that reloads the module compiled the same code again.)
    assert _patch.PRIVATE_TYPE not in torch_like.__dict__ and torch_like.wrap.__code__ == code, \
        "uninstalling leaves torch's code and module as they were"


def stand_in_of(construction: _patch.Construction) -> Any:
    return construction.module.__dict__[_patch.PRIVATE_TYPE]


def test_the_stand_in_is_the_builtin_for_every_other_call(patched: _patch.Construction) -> None:
    stand_in = stand_in_of(patched)
    assert stand_in(3) is int and stand_in("x") is str
    made = stand_in("Other", (Plain,), {"x": 1})
    assert isinstance(made, type) and made.__bases__ == (Plain,)
    assert made.__module__ == patched.module.__name__
    # A call of the site's shape whose name is not the prefix's is not the site's either.
    assert stand_in("Other", (patched.wrapper, Head), {}).__name__ == "Other"


def test_the_stand_in_answers_isinstance_issubclass_and_attributes_as_type(
    patched: _patch.Construction,
) -> None:
    stand_in = stand_in_of(patched)
    assert isinstance(Plain, stand_in) and not isinstance(Plain(), stand_in)
    assert issubclass(abc.ABCMeta, stand_in) and not issubclass(int, stand_in)
    assert stand_in.__name__ == "type" and stand_in.mro(int) == [int, object]


def test_plain_classes_get_torchs_class_built_per_call_as_torch_builds_it(
    patched: _patch.Construction,
) -> None:
    first, second = patched.module.wrap(Plain()), patched.module.wrap(Plain())
    assert first is not second, "one new class per call, as the builtin type makes"
    for built in (first, second):
        assert built.__bases__ == (patched.wrapper, Plain) and built.__module__ == patched.module.__name__


def public_names(module: types.ModuleType) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items() if not name.startswith("_")}


# inspect.signature evaluates string annotations on request from Python 3.10.
EVAL_STR = {"eval_str": True} if sys.version_info >= (3, 10) else {}


def what_users_read(module: types.ModuleType) -> dict[str, Any]:
    """What code outside the builder reads of the module: its names, a star import, ``eval``,
    the annotations resolved at run time."""
    star: dict[str, Any] = {}
    exec(f"from {module.__name__} import *", star)
    star.pop("__builtins__")
    return {
        "names": public_names(module), "star": star, "type": eval("type", vars(module)),
        "hints": typing.get_type_hints(module.wrap),
        "signature": inspect.signature(module.wrap, **EVAL_STR),
    }


def test_torchs_module_binds_the_same_names_with_the_patch_and_every_alias_reaches_it(
    torch_like: types.ModuleType,
) -> None:
    """Only the builder's own code finds the stand-in: the module's ``type`` stays the builtin,
    and an alias taken before the install (``from torch... import fully_shard``) is patched."""
    before = what_users_read(torch_like)
    alias = torch_like.wrap
    construction = _patch.resolve(site_of(torch_like))
    assert construction is not None
    _patch.install(construction)
    try:
        assert what_users_read(torch_like) == before and before["type"] is type
        assert "type" not in vars(torch_like) and before["hints"]["device"] is type
        built = alias(object.__new__(Head))
        assert refused(Head, type("WHead", (torch_like.Wrapper, Head), {})) is (built.__bases__[0] is not
                                                                            torch_like.Wrapper)
    finally:
        _patch.uninstall(construction)
    assert what_users_read(torch_like) == before


def test_the_builder_reads_its_attribute_named_type_as_before(patched: _patch.Construction) -> None:
    """``device.type`` shares the name ``type`` with the global: only the global's loads move."""
    module = patched.module
    assert {"type", _patch.PRIVATE_TYPE} <= set(module.wrap.__code__.co_names)
    instance = Plain()
    module.wrap(instance)
    assert instance.device_kind == "cpu"  # type: ignore[attr-defined]


@pytest.mark.parametrize("type_first", [True, False], ids=["no_room", "room"])
def test_code_with_no_room_for_the_new_name_is_refused_never_miscompiled(type_first: bool) -> None:
    """300 more names than a byte indexes, beside ``device.type``: where the global ``type``
    was compiled with a one-byte argument, the appended name does not fit it and the code is
    refused (the site then runs unpatched); where it has an EXTENDED_ARG, it is redirected and
    still right."""
    names = "\n".join(f"    n{index} = g{index}" for index in range(300))
    kind = "    kind = device.type\n    made = type('X', (), {})\n"
    body = f"{kind}{names}\n" if type_first else f"{names}\n{kind}"
    scope: dict[str, Any] = {f"g{index}": index for index in range(300)}
    exec(f"def build(device):\n{body}    return made, kind\n", scope)
    code = _patch.redirected(scope["build"].__code__, "type", "_other_type")
    if type_first:
        assert code is None
        return
    assert code is not None
    calls: list[str] = []
    scope["_other_type"] = lambda *args: calls.append(args[0]) or type(*args)
    scope["build"].__code__ = code
    made, kind = scope["build"](types.SimpleNamespace(type="cpu"))
    assert calls == ["X"] and kind == "cpu" and made.__name__ == "X"


def refused(cls: type, new: type) -> bool:
    """Does CPython refuse ``instance_of_cls.__class__ = new``? (Asked on an instance.)"""
    try:
        object.__new__(cls).__class__ = new
    except TypeError as error:
        assert "object layout differs" in str(error)
        return True
    return False


@pytest.mark.parametrize(("cls", "parent"), [(Head, "abc.ABC"), (GenericHead, "typing.Generic")])
def test_a_class_cpython_refuses_gets_one_compatible_class_that_it_accepts(
    patched: _patch.Construction, cls: type, parent: str
) -> None:
    module = patched.module
    name = f"W{cls.__name__}"
    # As torch builds it:
    upstream = _classes.called_from(module.__name__, type)(name, (module.Wrapper, cls), {})
    built = module.wrap(object.__new__(cls))
    if not refused(cls, upstream):
        # This CPython accepts torch's class (3.15 and the ABC case): the stand-in stands aside.
        assert built.__bases__ == (module.Wrapper, cls)
        return
    # One class per call, as torch builds it at this site (no cache), on the one mirror.
    again = module.wrap(object.__new__(cls))
    assert again is not built and again.__bases__[0] is built.__bases__[0]
    instance = object.__new__(cls)
    instance.__class__ = built
    assert isinstance(instance, module.Wrapper) and isinstance(instance, cls) and built.__mro__[2] is cls
    # Named after torch's module, or after ABCMeta's, whose own __new__ calls type's, as torch's is.
    assert built.__name__ == name and built.__module__ == upstream.__module__
    site = f"{module.__name__}.wrap"
    kept = [r for r in _classes.records.snapshot()[0] if r.name == cls.__qualname__ and r.site == site]
    assert [(r.outcome, r.parent) for r in kept] == [(_classes.COMPATIBLE, parent)]


def wrapped_classes_die(module: types.ModuleType, cls_body: str) -> list[bool]:
    """Wrap instances of 20 classes made in a function, drop them: which classes are still alive
    after a collection (each original class, and the class its module got)."""
    refs = []
    for _ in range(20):
        scope: dict[str, Any] = {"abc": abc, "Plain": Plain}
        exec(cls_body, scope)
        instance = object.__new__(scope["Made"])
        try:
            module.wrap(instance)
        except TypeError:
            pass  # the layout error, unpatched
        refs += [weakref.ref(scope["Made"]), weakref.ref(type(instance))]
        del scope, instance
    gc.collect()
    return [ref() is not None for ref in refs]


@pytest.mark.parametrize("cls_body", ["class Made(abc.ABC, Plain): pass", "class Made(Plain): pass"],
                         ids=["abc_first", "plain"])
def test_every_class_can_die_as_without_the_patch(torch_like: types.ModuleType, cls_body: str) -> None:
    """The package lists each class without keeping it: the original, torch's class and the
    compatible one are freed as torch alone frees them (here: with the modules)."""
    assert not any(wrapped_classes_die(torch_like, cls_body)), "the module keeps no class by itself"
    construction = _patch.resolve(site_of(torch_like))
    assert construction is not None
    _patch.install(construction)
    try:
        assert not any(wrapped_classes_die(torch_like, cls_body))
        assert len(construction.recorded) == 0
    finally:
        _patch.uninstall(construction)


def test_users_class_hooks_never_see_a_mirror(torch_like: types.ModuleType) -> None:
    """A user's empty-slots base with a registry: it receives the class its module gets, one
    per call as without the patch, never a mirror named after the wrapper."""
    registry: list[str] = []

    class Registry:
        __slots__ = ()

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            registry.append(cls.__name__)

    class RegisteredHead(Registry, Plain):
        pass

    bug = refused(RegisteredHead, type("WRegisteredHead", (torch_like.Wrapper, RegisteredHead), {}))
    registry.clear()
    try:
        torch_like.wrap(object.__new__(RegisteredHead))
    except TypeError as error:
        assert bug and "object layout differs" in str(error)
    assert registry == ["WRegisteredHead"]
    construction = _patch.resolve(site_of(torch_like))
    assert construction is not None
    _patch.install(construction)
    try:
        registry.clear()
        instance = object.__new__(RegisteredHead)
        torch_like.wrap(instance)
        torch_like.wrap(object.__new__(RegisteredHead))
    finally:
        _patch.uninstall(construction)
    # One class per call, as torch alone builds (and registers) it: the compatible one where
    # CPython refuses torch's, torch's own where it accepts it (3.15); never the mirror.
    assert registry == ["WRegisteredHead", "WRegisteredHead"] and "Wrapper" not in registry
    assert isinstance(instance, torch_like.Wrapper)
    assert (type(instance).__bases__[0] is not torch_like.Wrapper) is bug


def test_no_lock_is_held_while_a_class_hook_wraps_from_another_thread(torch_like: types.ModuleType) -> None:
    """A class hook that starts a thread which wraps a module, and waits for it: completes, as
    with torch alone, instead of the thread waiting for a lock this thread holds."""
    finished: list[bool] = []

    class Spawning:
        __slots__ = ()

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            if cls.__name__ == "WSpawningHead" and not finished:
                worker = threading.Thread(target=lambda: finished.append(bool(torch_like.wrap(Plain()))))
                worker.start()
                worker.join(timeout=60)
                assert not worker.is_alive(), "the wrapping thread is blocked"

    class SpawningHead(Spawning, Plain):
        pass

    construction = _patch.resolve(site_of(torch_like))
    assert construction is not None
    _patch.install(construction)
    try:
        torch_like.wrap(object.__new__(SpawningHead))
    finally:
        _patch.uninstall(construction)
    assert finished == [True]


def test_threads_racing_on_one_class_get_a_class_each_and_one_record(patched: _patch.Construction) -> None:
    class RacingHead(abc.ABC, Plain):
        pass

    instances = [object.__new__(RacingHead) for _ in range(8)]
    start = threading.Barrier(len(instances))

    def wrap(instance: object) -> None:
        start.wait()
        patched.module.wrap(instance)

    threads = [threading.Thread(target=wrap, args=(instance,)) for instance in instances]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # One class per call, as torch builds it here (no cache): each accepted, on one shared mirror
    # where CPython refuses torch's own.
    classes = {type(instance) for instance in instances}
    assert len(classes) == len(instances)
    if refused(RacingHead, type("WRacingHead", (patched.module.Wrapper, RacingHead), {})):
        assert len({c.__bases__[0] for c in classes}) == 1
        assert all(c.__bases__[0] is not patched.module.Wrapper for c in classes)
    else:  # 3.15 accepts torch's class
        assert all(c.__bases__[0] is patched.module.Wrapper for c in classes)
    records = [r for r in _classes.records.snapshot()[0] if r.name.endswith("RacingHead")]
    assert len(records) == 1


def test_a_type_bound_after_the_install_is_the_users_and_the_site_says_it_is_undone(
    patched: _patch.Construction,
) -> None:
    """As without the patch, the builder calls the module's ``type`` once a user rebinds it;
    the status, which asks ``undone``, then no longer counts the site."""
    module, calls = patched.module, []
    assert _patch.undone(patched) is None

    class Spy:
        """A ``type`` of the user's: records the classes built, checks classes as type does."""

        def __call__(self, *args: Any) -> Any:
            calls.append(args[0] if len(args) == 3 else "other")
            return type(*args)

        def __instancecheck__(self, instance: Any) -> bool:
            return isinstance(instance, type)

    module.type = Spy()  # type: ignore[attr-defined]
    try:
        module.wrap(Plain())
        assert calls == ["WPlain"]
        assert f"{module.__name__}.type was rebound" in str(_patch.undone(patched))
    finally:
        del module.type  # type: ignore[attr-defined]
    assert _patch.undone(patched) is None


def test_a_reloaded_module_is_said_to_be_undone(patched: _patch.Construction) -> None:
    reload(patched.module)
    assert _patch.undone(patched) == f"{patched.module.__name__} was reloaded, which made a new wrap"


def test_a_type_bound_before_the_install_is_named(torch_like: types.ModuleType) -> None:
    torch_like.type = lambda *args: type(*args)  # type: ignore[attr-defined]
    site = site_of(torch_like)
    assert _patch.resolve(site) is None
    problem = _patch.user_binding(site)
    assert problem is not None and problem.startswith(f"{torch_like.__name__}.type is <function ")
    assert problem.endswith("not the builtin: bound before fsdp-autopatch installed")


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
        inline = _sites.Site("stand-in API", (0,), module.__name__, "wrap", ("Wrapper",), "W", "deepcopy",
                             builder=(module.__name__, "wrap_impl", ()))
        construction = _patch.resolve(inline)
        assert construction is not None and construction.helper is None
        shared = _sites.Site("stand-in API", (0,), module.__name__, "wrap", ("Wrapper",), "W", "deepcopy",
                             builder=("torch_helper_stand_in", "wrap_impl", ()))
        helper_module = types.ModuleType("torch_helper_stand_in")
        exec(INLINE_BUILDER, helper_module.__dict__)
        sys.modules[helper_module.__name__] = helper_module
        construction = _patch.resolve(shared)
        assert construction is not None and construction.helper is module.wrap_impl
    finally:
        sys.modules.pop(module.__name__, None)
        sys.modules.pop("torch_helper_stand_in", None)


def test_a_frame_is_the_packages_only_when_its_file_is_in_the_package_directory() -> None:
    """A user's ``site-packages/fsdp_autopatch_userhooks/`` keeps its frames in tracebacks."""
    directory = os.path.dirname(_patch.__file__)
    assert _patch._is_own(_patch.__file__) and _patch._is_own(os.path.join(directory, "_wrapper_cls.py"))
    neighbour = os.path.join(os.path.dirname(directory), "fsdp_autopatch_userhooks", "hooks.py")
    assert not _patch._is_own(neighbour)
