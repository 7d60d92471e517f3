"""Made-up torch 99.3 (tests/programs/made_up_releases.py): 99.2's made_up_wrap, with torch's fix
(upstream/torch.diff): it calls make_wrapper_cls in place of type."""

from typing import Any, NoReturn

from torch.distributed._wrapper_cls import make_wrapper_cls

cls_to_made_up_cls: "dict[type, type]" = {}


def made_up_wrap(module: Any) -> Any:
    cls = module.__class__
    new_cls = cls_to_made_up_cls.get(cls)
    if not new_cls:
        dct = {"__deepcopy__": _unimplemented_deepcopy}
        new_cls = make_wrapper_cls(f"MadeUp{cls.__name__}", (MadeUpModule, cls), dct)
        cls_to_made_up_cls[cls] = new_cls
    module.__class__ = new_cls
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("made_up_wrap does not support deepcopy")


class MadeUpModule:
    pass
