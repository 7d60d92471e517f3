"""Made-up torch 99.2 (tests/programs/made_up_releases.py): a new API in a module of its own,
made_up_wrap, which swaps a module's class the same way: MadeUp<Name>(MadeUpModule, cls),
built inline and cached."""

from typing import Any, NoReturn

cls_to_made_up_cls: "dict[type, type]" = {}


def made_up_wrap(module: Any) -> Any:
    cls = module.__class__
    new_cls = cls_to_made_up_cls.get(cls)
    if not new_cls:
        dct = {"__deepcopy__": _unimplemented_deepcopy}
        new_cls = type(f"MadeUp{cls.__name__}", (MadeUpModule, cls), dct)
        cls_to_made_up_cls[cls] = new_cls
    module.__class__ = new_cls
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("made_up_wrap does not support deepcopy")


class MadeUpModule:
    pass
