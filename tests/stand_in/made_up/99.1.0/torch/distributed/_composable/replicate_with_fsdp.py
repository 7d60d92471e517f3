"""Made-up torch 99.1 (tests/programs/made_up_releases.py): the stand-in's FSDP2 replicate, calling
the shared helper where 99.1 moved it."""

from typing import Any, NoReturn

from torch.distributed._composable._swap_class import _apply_to_module
from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

cls_to_replicate_cls: "dict[type, type]" = {}


def replicate(module: Any, **kwargs: Any) -> Any:
    _apply_to_module(ReplicateModule, (module,), cls_to_replicate_cls, "Replicate", _unimplemented_deepcopy)
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("Replicate does not support deepcopy. Please use state dict for serialization.")


class ReplicateModule(FSDPModule):
    _orig_cls_mro_index: int = 3
