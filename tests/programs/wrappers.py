"""torch's calls that swap a module's class, for the test programs about what the patch must leave
as torch makes it (tests/programs/construction_hooks.py, monkeypatched.py, side_effects.py,
shards_while_built.py), named as tests/test_fully_shard.py names them.

    Wrapper, PREFIX, METHOD, ARGS, wrap = under_test("fully_shard")   # "DDP replicate", "FSDP2 replicate"

Wrapper is torch's wrapper class, PREFIX the prefix of the classes it builds, METHOD and ARGS a
method of Wrapper's own and arguments to call it with, ``wrap(module, mesh)`` the call.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, NamedTuple


class UnderTest(NamedTuple):
    Wrapper: type
    PREFIX: str
    METHOD: str
    ARGS: tuple[Any, ...]
    wrap: Callable[[Any, Any], None]


def fsdp2() -> UnderTest:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    def wrap(module: Any, mesh: Any) -> None:
        fully_shard(module, mesh=mesh)

    return UnderTest(FSDPModule, "FSDP", "reshard", (), wrap)


def composable_ddp() -> UnderTest:
    # Composable DDP builds a new class on every call (no cache).
    replicate_module = importlib.import_module("torch.distributed._composable.replicate")

    def wrap(module: Any, mesh: Any) -> None:
        replicate_module.replicate(module)

    return UnderTest(replicate_module.DDP, "DDP", "set_requires_gradient_sync", (True,), wrap)


def fsdp2_replicate() -> UnderTest:
    from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate

    def wrap(module: Any, mesh: Any) -> None:
        replicate(module, mesh=mesh)

    return UnderTest(ReplicateModule, "Replicate", "reshard", (), wrap)


WRAPPERS: dict[str, Callable[[], UnderTest]] = {"fully_shard": fsdp2, "DDP replicate": composable_ddp}
# The three calls that swap a module's class in torch, for the tests that go through each.
THREE_CALLS: dict[str, Callable[[], UnderTest]] = {**WRAPPERS, "FSDP2 replicate": fsdp2_replicate}


def under_test(name: str) -> UnderTest:
    return THREE_CALLS[name]()
