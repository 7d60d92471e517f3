# Owner(s): ["oncall: distributed"]
"""
fully_shard, FSDP's replicate and composable DDP's replicate swap a module's class
for ``(Wrapper, cls)``. Python refuses that swap when ``cls`` puts a base with empty
``__slots__`` (``abc.ABC``, ``typing.Generic[T]``) ahead of ``nn.Module``
("object layout differs", https://github.com/pytorch/pytorch/issues/160068).
"""

import abc
import copy
from typing import Generic, TypeVar

import torch
import torch.nn as nn
from torch.distributed._composable import replicate as ddp_replicate
from torch.distributed._composable.replicate import DDP
from torch.distributed._composable.replicate_with_fsdp import (
    replicate,
    ReplicateModule,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.testing._internal.common_fsdp import FSDPTestMultiThread, MLP
from torch.testing._internal.common_utils import run_tests


T = TypeVar("T")


class ABCFirstMLP(abc.ABC, MLP):
    pass


class GenericFirstMLP(Generic[T], MLP):
    pass


class ABCLastMLP(MLP, abc.ABC):
    pass


class NamedMLP(MLP):
    # A method of the module's own class that FSDPModule also defines: the
    # wrapper's must win, as it does in ``(FSDPModule, cls)``.
    def reshard(self):
        raise AssertionError("the module's reshard shadows FSDPModule's")


class ABCFirstNamedMLP(abc.ABC, NamedMLP):
    pass


class TestWrapperClassLayout(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def _wrappers(self):
        """(wrap function, wrapper class, prefix, MRO index of the original class)."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        return [
            (lambda m: fully_shard(m, mesh=mesh), FSDPModule, "FSDP", 2),
            (lambda m: replicate(m, mesh=mesh), ReplicateModule, "Replicate", 3),
            (ddp_replicate, DDP, "DDP", 2),
        ]

    def test_empty_slots_first_modules_wrap(self):
        for wrap, wrapper_cls, prefix, orig_index in self._wrappers():
            for cls in (ABCFirstMLP, GenericFirstMLP, ABCFirstNamedMLP):
                module = wrap(cls(8))
                new_cls = type(module)
                self.assertEqual(new_cls.__name__, f"{prefix}{cls.__name__}")
                self.assertIsInstance(module, wrapper_cls)
                self.assertIsInstance(module, cls)
                self.assertIs(new_cls.__mro__[orig_index], cls)
                self.assertIs(new_cls.__mro__[0], new_cls)
                self.assertIsInstance(module, FSDPModule if prefix != "DDP" else DDP)
                # The wrapper's methods resolve ahead of the module's, as in
                # ``(wrapper_cls, cls)``.
                if wrapper_cls is not DDP:
                    self.assertIs(new_cls.reshard, FSDPModule.reshard)
                # One class per original class, as for any other module.
                if wrapper_cls is not DDP:
                    self.assertIs(type(wrap(cls(8))), new_cls)

    def test_other_modules_keep_their_class(self):
        for wrap, wrapper_cls, _, _ in self._wrappers():
            for cls in (MLP, ABCLastMLP, NamedMLP):
                module = wrap(cls(8))
                self.assertEqual(type(module).__bases__, (wrapper_cls, cls))

    def test_empty_slots_first_modules_train(self):
        # The ranks are threads of one process: each draws from a generator of its
        # own, so that all start from the same parameters and see the same inputs.
        gen = torch.Generator().manual_seed(42)
        for wrap, _, _, _ in self._wrappers():
            for cls in (ABCFirstMLP, GenericFirstMLP):
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


if __name__ == "__main__":
    run_tests()
