"""torch 2.11 - 2.15's shared helper, as torch writes it (_fsdp_init.py, lines 404-430 in 2.15.0)."""

from typing import Any, Callable


def _apply_to_module(
    modules: "tuple[Any, ...]",
    cls_to_wrapper_cls: "dict[type, type]",
    wrapper_module_cls: type,
    wrapper_cls_prefix: str,
    unimplemented_deepcopy: Callable[..., Any],
) -> None:
    for module in modules:
        cls = module.__class__
        new_cls = cls_to_wrapper_cls.get(cls)
        if not new_cls:
            dct = {"__deepcopy__": unimplemented_deepcopy}
            new_cls = type(f"{wrapper_cls_prefix}{cls.__name__}", (wrapper_module_cls, cls), dct)
            cls_to_wrapper_cls[cls] = new_cls
        module.__class__ = new_cls
