"""Classes whose metaclass compares them by name, or cannot hash them, wrapped by each of torch's
wrappers (and Megatron-FSDP's), for tests/test_invisible.py: the package must tell classes apart
by identity, as torch's own code does, never by a user's ``__eq__`` or ``__hash__``.

    python tests/programs/identity_classes.py [--abc-last]

Cases, each module built from its own class and wrapped in turn:

- ``same name``: two different classes, both named ``Head``, from two "model files";
- ``abc then plain``: a ``Head`` whose layout needs the fix, then another ``Head`` whose does not;
- ``unhashable``: a plain module whose metaclass defines ``__eq__`` and no ``__hash__``.

The heads put ``abc.ABC`` first, or, ``--abc-last``, last: the twin torch alone wraps, which the
first run must behave as. One JSON object: per wrapper and case, per module, "wrapped" or the
error, whether its own class is in its class's MRO, and whose ``forward`` it runs.
"""

from __future__ import annotations

import abc
import json
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from torch.distributed._composable.replicate import replicate as ddp_replicate
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp2_replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_autopatch import _verify


class ByName(abc.ABCMeta):
    """Classes equal when their qualified names are, hashed alike (as some registries do)."""

    def __eq__(cls, other: object) -> bool:
        return isinstance(other, type) and cls.__qualname__ == other.__qualname__

    def __hash__(cls) -> int:
        return hash(cls.__qualname__)


class Unhashable(type):
    """A metaclass with ``__eq__`` and no ``__hash__``: its classes cannot be hashed."""

    def __eq__(cls, other: object) -> bool:
        return cls is other


def head(origin: str, abc_first: bool) -> type:
    """A class named ``Head``, as a model file ``origin`` defines it; its forward says which."""
    bases = (abc.ABC, nn.Linear) if abc_first else (nn.Linear, abc.ABC)

    def forward(self: Any, x: torch.Tensor) -> str:
        return origin

    return ByName("Head", bases, {"forward": forward, "__module__": origin, "__qualname__": "Head"})


def plain_unhashable() -> type:
    return Unhashable("Plain", (nn.Linear,), {"forward": lambda self, x: "plain"})


def wrapped(wrap: Callable[[nn.Module], Any], cls: type) -> dict[str, Any]:
    module = cls(2, 2)
    try:
        wrap(module)
    except TypeError as error:
        return {"wrapped": False, "error": "layout" if _verify.LAYOUT_ERROR in str(error) else str(error)}
    return {"wrapped": True, "own_class_in_mro": any(c is cls for c in type(module).__mro__),
            "forward": type(module).forward(module, None)}


def main(argv: list[str]) -> int:
    abc_first = "--abc-last" not in argv
    mesh = _verify.init_process_group()
    wrappers: dict[str, Callable[[nn.Module], Any]] = {
        "fully_shard": lambda module: fully_shard(module, mesh=mesh),
        "FSDP2 replicate": lambda module: fsdp2_replicate(module, mesh=mesh),
        "DDP replicate": ddp_replicate,
    }
    try:
        import megatron_fsdp.experimental as megatron

        flat = [megatron.Flat()]
        placements = megatron.Placements(dp_axes=[0], parameter=flat, gradient=flat, optimizer=flat)
        megatron_mesh = init_device_mesh("cpu", (1,))
        wrappers["Megatron-FSDP"] = lambda module: megatron.fully_shard(module, megatron_mesh, placements)
    except ImportError:  # Python 3.9: megatron-fsdp needs 3.10
        pass
    report = {}
    for name, wrap in wrappers.items():
        report[name] = {
            "same name": [wrapped(wrap, head(origin, abc_first)) for origin in ("model_a", "model_b")],
            "abc then plain": [wrapped(wrap, head("model_a", abc_first)),
                               wrapped(wrap, head("model_b", False))],
            "unhashable": [wrapped(wrap, plain_unhashable())],
        }
    print(json.dumps(report, sort_keys=True))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
