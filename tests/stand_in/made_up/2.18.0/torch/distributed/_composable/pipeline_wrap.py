"""Made-up torch 2.18 (tests/programs/made_up_releases.py): 2.17's pipeline_wrap, with torch's fix
(upstream/torch.diff): it calls make_wrapper_cls in place of type."""

from typing import Any, NoReturn

from torch.distributed._wrapper_cls import make_wrapper_cls

cls_to_pipeline_cls: "dict[type, type]" = {}


def pipeline_wrap(module: Any) -> Any:
    cls = module.__class__
    new_cls = cls_to_pipeline_cls.get(cls)
    if not new_cls:
        dct = {"__deepcopy__": _unimplemented_deepcopy}
        new_cls = make_wrapper_cls(f"Pipeline{cls.__name__}", (PipelineModule, cls), dct)
        cls_to_pipeline_cls[cls] = new_cls
    module.__class__ = new_cls
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("pipeline_wrap does not support deepcopy")


class PipelineModule:
    pass
