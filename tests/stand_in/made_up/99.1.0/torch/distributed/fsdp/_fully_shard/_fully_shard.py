"""Made-up torch 99.1 (tests/programs/made_up_releases.py): the stand-in's fully_shard, calling
the shared helper where 99.1 moved it."""

import functools
from typing import Any, Callable, NoReturn

from torch.distributed._composable._swap_class import _apply_to_module

cls_to_fsdp_cls: "dict[type, type]" = {}


def contract() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Stands in for torch.distributed._composable.contract: a functools.wraps decorator."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
            return function(module, *args, **kwargs)

        return wrapper

    return decorate


@contract()
def fully_shard(module: Any, *, mesh: Any = None, reshard_after_forward: bool = True) -> Any:
    modules = (module,)
    _apply_to_module(FSDPModule, modules, cls_to_fsdp_cls, "FSDP", _unimplemented_deepcopy)
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


class FSDPModule:
    # torch's: where the original class sits in a wrapper class's MRO (ReplicateModule: 3).
    _orig_cls_mro_index: int = 2

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # torch's: a sliced container is built as the original class.
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def reshard(self) -> None:
        pass
