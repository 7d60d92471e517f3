"""Made-up torch 99.3 (tests/programs/made_up_releases.py): composable DDP's replicate, with
torch's fix as upstream/torch.diff has it: make_wrapper_cls called in place of type."""

from typing import Any, NoReturn

from torch.distributed._wrapper_cls import make_wrapper_cls


def unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("DDP does not support deepcopy. Please use state dict for serialization.")


class DDP:
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        orig_cls = cls.__mro__[2]
        return orig_cls.__new__(orig_cls, *args, **kwargs)


def replicate(module: Any, **kwargs: Any) -> Any:
    if "device_id" in kwargs and not isinstance(kwargs["device_id"], int):
        raise RuntimeError(f"Expected device_id to be int, but got {type(kwargs['device_id'])}")
    cls = module.__class__
    dct = {"__deepcopy__": unimplemented_deepcopy}
    new_cls = make_wrapper_cls(f"DDP{cls.__name__}", (DDP, cls), dct)
    module.__class__ = new_cls
    return module
