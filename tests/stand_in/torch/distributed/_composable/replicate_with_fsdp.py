"""FSDP2's replicate (torch 2.11 - 2.15): ReplicateModule classes built by the shared helper."""

from typing import Any, NoReturn

from torch.distributed.fsdp._fully_shard._fsdp_init import _apply_to_module
from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

cls_to_replicate_cls: "dict[type, type]" = {}


def replicate(module: Any, **kwargs: Any) -> Any:
    _apply_to_module((module,), cls_to_replicate_cls, ReplicateModule, "Replicate", _unimplemented_deepcopy)
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("Replicate does not support deepcopy. Please use state dict for serialization.")


class ReplicateModule(FSDPModule):
    _orig_cls_mro_index: int = 3
