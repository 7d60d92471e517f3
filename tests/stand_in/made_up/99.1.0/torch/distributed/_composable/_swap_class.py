"""Made-up torch 99.1 (tests/programs/made_up_releases.py): the helper FSDP2's fully_shard and
replicate share, moved here from fsdp/_fully_shard/_fsdp_init.py (which keeps the old one), its
parameters renamed and reordered."""

from typing import Any, Callable


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
            new_cls = type(f"{prefix}{cls.__name__}", (wrapper_cls, cls), dct)
            cache[cls] = new_cls
        module.__class__ = new_cls
