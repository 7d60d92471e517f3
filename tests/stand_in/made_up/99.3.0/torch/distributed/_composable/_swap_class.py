"""Made-up torch 99.3 (tests/programs/made_up_releases.py): 99.1's shared helper, with torch's fix
(upstream/torch.diff): it calls make_wrapper_cls in place of type."""

from typing import Any, Callable

from torch.distributed._wrapper_cls import make_wrapper_cls


def _apply_to_module(
    wrapper_cls: type,
    modules: "tuple[Any, ...]",
    cache: "dict[type, type]",
    prefix: str,
    deepcopy_fn: Callable[..., Any],
) -> None:
    for module in modules:
        cls = module.__class__
        new_cls = cache.get(cls)
        if not new_cls:
            dct = {"__deepcopy__": deepcopy_fn}
            new_cls = make_wrapper_cls(f"{prefix}{cls.__name__}", (wrapper_cls, cls), dct)
            cache[cls] = new_cls
        module.__class__ = new_cls
