# Owner(s): ["oncall: distributed"]
"""
fully_shard, FSDP's replicate and composable DDP's replicate switch a module's
class to ``make_wrapper_cls(name, (wrapper_cls, cls), namespace)``. Python
refuses ``(wrapper_cls, cls)`` when ``cls`` puts a base with empty
``__slots__`` ahead of ``nn.Module``; these modules must wrap and train, and
every other module must keep exactly that class.
"""

import abc
import collections
import collections.abc
import copy
import gc
import sys
import threading
import typing
from typing import Generic, Protocol, TypeVar

import torch
import torch.nn as nn
from torch.distributed._composable import replicate as ddp_replicate
from torch.distributed._composable.replicate import DDP
from torch.distributed._composable.replicate_with_fsdp import replicate, ReplicateModule
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_init
from torch.testing._internal.common_fsdp import FSDPTestMultiThread, MLP
from torch.testing._internal.common_utils import run_tests, TestCase


T = TypeVar("T")


class ABCFirstMLP(abc.ABC, MLP):
    pass


class SubclassOfABCFirstMLP(ABCFirstMLP):
    pass


class GenericFirstMLP(Generic[T], MLP):  # noqa: PYI059 (the shape under test)
    pass


class SizedFirstMLP(typing.Sized, MLP):
    def __len__(self) -> int:
        return 2


class IterableFirstMLP(collections.abc.Iterable, MLP):
    def __iter__(self):
        return iter((self.in_proj, self.out_proj))


class Proto(Protocol):
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...


class ProtocolFirstMLP(Proto, MLP):
    def __init__(self, dim: int) -> None:
        MLP.__init__(self, dim)  # a protocol's ``__init__`` does not chain to MLP's

    forward = MLP.forward


class ReshardingMLP(abc.ABC, MLP):
    # A method of the module's that FSDPModule also defines: the wrapper's must
    # win, as it does in ``(FSDPModule, cls)``.
    def reshard(self) -> None:
        raise AssertionError("the module's reshard shadows FSDPModule's")


class Logging(abc.ABC):  # noqa: B024
    __slots__ = ()


class LoggedReshardingMLP(Logging, ReshardingMLP):
    # Its MRO puts ReshardingMLP between the mirror's base (Logging) and ABC:
    # ahead of FSDPModule in the class built, as its own method is.
    pass


class ABCLastMLP(MLP, abc.ABC):
    pass


class ABCSequential(abc.ABC, nn.Sequential):
    pass


EMPTY_SLOTS_FIRST = (
    ABCFirstMLP,
    SubclassOfABCFirstMLP,
    GenericFirstMLP,
    SizedFirstMLP,
    IterableFirstMLP,
    ProtocolFirstMLP,
)


# Where each call builds its classes: ``type()`` names a class after the module
# of the code that calls it, or ``abc`` where ABCMeta's own ``__new__`` calls it.
BUILDERS = {
    "fully_shard": _fsdp_init.__name__,
    "replicate": _fsdp_init.__name__,
    "ddp": DDP.__module__,
}


class TestWrapperCls(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _wrappers(self):
        """(name, wrap function, wrapper class, prefix, the module class's MRO index)."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        return (
            ("fully_shard", lambda m: fully_shard(m, mesh=mesh), FSDPModule, "FSDP", 2),
            (
                "replicate",
                lambda m: replicate(m, mesh=mesh),
                ReplicateModule,
                "Replicate",
                3,
            ),
            ("ddp", ddp_replicate, DDP, "DDP", 2),
        )

    def test_empty_slots_first_modules_wrap(self):
        for name, wrap, wrapper_cls, prefix, index in self._wrappers():
            for cls in (*EMPTY_SLOTS_FIRST, ReshardingMLP, LoggedReshardingMLP):
                with self.subTest(wrapper=name, cls=cls.__name__):
                    module = wrap(cls(8))
                    new_cls = type(module)
                    self.assertEqual(new_cls.__name__, f"{prefix}{cls.__name__}")
                    self.assertIsInstance(module, wrapper_cls)
                    self.assertIs(new_cls.__mro__[index], cls)
                    self.assertIs(type(new_cls), type(cls))
                    if wrapper_cls is not DDP:
                        module.reshard()  # FSDPModule's, not ReshardingMLP's
                        # One class per module class, as for any other module.
                        self.assertIs(type(wrap(cls(8))), new_cls)
                    with self.assertRaisesRegex(AssertionError, "deepcopy"):
                        copy.deepcopy(module)

    def test_mirrors_tell_themselves_apart(self):
        for name, wrap, wrapper_cls, _, _ in self._wrappers():
            with self.subTest(wrapper=name):
                new_cls = type(wrap(GenericFirstMLP(8)))
                names = [c.__qualname__ for c in new_cls.__mro__]
                self.assertEqual(names.count(wrapper_cls.__qualname__), 1)
                self.assertIn(f"Generic{wrapper_cls.__qualname__}", names)

    def test_other_modules_keep_their_class(self):
        for name, wrap, wrapper_cls, _, _ in self._wrappers():
            for cls, made_in in ((MLP, BUILDERS[name]), (ABCLastMLP, "abc")):
                with self.subTest(wrapper=name, cls=cls.__name__):
                    new_cls = type(wrap(cls(8)))
                    self.assertEqual(new_cls.__bases__, (wrapper_cls, cls))
                    self.assertIs(type(new_cls), type(cls))
                    self.assertEqual(new_cls.__module__, made_in)

    def test_no_code_of_the_module_class_runs_but_what_type_runs(self):
        calls = collections.Counter()

        class Counting(abc.ABCMeta):
            def __getattribute__(cls, name):
                calls["metaclass __getattribute__"] += 1
                return super().__getattribute__(name)

            def __new__(mcs, name, bases, namespace, **kwargs):
                calls["metaclass __new__"] += 1
                return super().__new__(mcs, name, bases, namespace, **kwargs)

            def __init__(cls, *args, **kwargs):
                calls["metaclass __init__"] += 1
                super().__init__(*args, **kwargs)

            def __call__(cls, *args, **kwargs):
                calls["metaclass __call__"] += 1
                return super().__call__(*args, **kwargs)

        class Named:
            def __set_name__(self, owner, name):
                calls["__set_name__"] += 1

        class Hooks(metaclass=Counting):
            __slots__ = ()
            named = Named()

            def __new__(cls, *args, **kwargs):
                calls["__new__"] += 1
                return super().__new__(cls)

            def __init__(self, *args, **kwargs):
                calls["__init__"] += 1
                super().__init__(*args, **kwargs)

            def __del__(self):
                calls["__del__"] += 1

            def __init_subclass__(cls, **kwargs):
                super().__init_subclass__(**kwargs)
                calls["__init_subclass__"] += 1

        class HooksFirstMLP(Hooks, MLP):
            pass

        class HooksLastMLP(MLP, Hooks):
            pass

        # Every module lives to the end: the ranks are threads of one process.
        kept = []
        for name, wrap, _, _, _ in self._wrappers():
            counted = {}
            for cls in (HooksFirstMLP, HooksLastMLP):
                with self.subTest(wrapper=name, cls=cls.__name__):
                    modules = [cls(8), cls(8)]
                    kept += modules
                    gc.collect()
                    calls.clear()
                    for module in modules:
                        wrap(module)
                    gc.collect()
                    counted[cls] = dict(calls)
                    # ``type()`` ran once per class built: once per call for ddp.
                    once = 2 if name == "ddp" else 1
                    reads = calls.pop("metaclass __getattribute__", 0)
                    self.assertGreater(reads, 0)
                    self.assertEqual(
                        calls,
                        {
                            "metaclass __new__": once,
                            "metaclass __init__": once,
                            "__init_subclass__": once,
                        },
                    )
            # Not one attribute more is read through the metaclass.
            self.assertEqual(counted[HooksFirstMLP], counted[HooksLastMLP])

    def test_one_class_per_call(self):
        for name, wrap, _, prefix, _ in self._wrappers():
            with self.subTest(wrapper=name):
                created = []

                class Counted(MLP):
                    def __init_subclass__(cls, **kwargs):
                        super().__init_subclass__(**kwargs)
                        created.append(cls.__name__)

                class ABCFirstCounted(abc.ABC, Counted):
                    pass

                created.clear()
                module = wrap(ABCFirstCounted(8))
                self.assertEqual(created, [f"{prefix}ABCFirstCounted"])
                self.assertIs(type(module).__mro__[0], type(module))

    def test_sliced_container_keeps_its_class(self):
        for name, wrap, _, _, _ in self._wrappers():
            with self.subTest(wrapper=name):
                seq = ABCSequential(MLP(8), MLP(8), MLP(8))
                wrap(seq)
                self.assertIs(type(seq[0:2]), ABCSequential)

    def test_empty_slots_first_modules_train(self):
        # The ranks are threads of one process: each draws from a generator of
        # its own, so that all start from the same parameters and inputs.
        gen = torch.Generator().manual_seed(42)
        for name, wrap, _, _, _ in self._wrappers():
            for cls in EMPTY_SLOTS_FIRST:
                with self.subTest(wrapper=name, cls=cls.__name__):
                    model = cls(8)
                    with torch.no_grad():
                        for param in model.parameters():
                            param.copy_(torch.randn(param.shape, generator=gen))
                    ref_model = copy.deepcopy(model)
                    ref_optim = torch.optim.SGD(ref_model.parameters(), lr=1e-2)
                    wrap(model)
                    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
                    for _ in range(3):
                        inp = torch.randn((4, 8), generator=gen)
                        losses = []
                        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                            _optim.zero_grad()
                            loss = _model(inp).sum()
                            loss.backward()
                            _optim.step()
                            losses.append(loss.detach())
                        self.assertEqual(losses[0], losses[1])

    def test_compiled_empty_slots_first_module(self):
        gen = torch.Generator().manual_seed(0)
        for name, wrap, _, _, _ in self._wrappers():
            with self.subTest(wrapper=name):
                model = ABCFirstMLP(8)
                with torch.no_grad():
                    for param in model.parameters():
                        param.copy_(torch.randn(param.shape, generator=gen))
                wrap(model)
                inp = torch.randn((4, 8), generator=gen)
                self.assertEqual(torch.compile(model, backend="eager")(inp), model(inp))


class TestMakeWrapperCls(TestCase):
    def test_threads_building_at_once_share_one_mirror_per_base(self):
        from torch.distributed._wrapper_cls import make_wrapper_cls

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            for _ in range(10):
                base = abc.ABCMeta("Base", (abc.ABC,), {"__slots__": ()})
                classes = [type(f"Head{i}", (base, MLP), {}) for i in range(8)]
                barrier = threading.Barrier(len(classes))
                mirrors = []

                def build(cls, barrier=barrier, mirrors=mirrors):
                    barrier.wait()
                    built = make_wrapper_cls("FSDPHead", (FSDPModule, cls), {})
                    mirrors.append(built.__bases__[0])

                threads = [threading.Thread(target=build, args=(c,)) for c in classes]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                self.assertEqual(len({id(mirror) for mirror in mirrors}), 1)
        finally:
            sys.setswitchinterval(interval)

    def test_what_a_mirror_shows(self):
        from torch.distributed._wrapper_cls import make_wrapper_cls

        built = make_wrapper_cls(
            "FSDPGenericFirstMLP", (FSDPModule, GenericFirstMLP), {}
        )
        mirror = built.__bases__[0]
        self.assertIs(type(mirror), type)
        self.assertIn(mirror, Generic.__subclasses__())
        self.assertIn(mirror, FSDPModule.__subclasses__())
        self.assertEqual(mirror.__qualname__, "GenericFSDPModule")


if __name__ == "__main__":
    run_tests()
