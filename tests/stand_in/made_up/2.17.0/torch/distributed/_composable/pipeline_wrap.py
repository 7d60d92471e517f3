"""Made-up torch 2.17 (tests/programs/made_up_releases.py): a new API in a module of its own,
pipeline_wrap, which swaps a module's class the same way: Pipeline<Name>(PipelineModule, cls),
built inline and cached."""

from typing import Any, NoReturn

cls_to_pipeline_cls: "dict[type, type]" = {}


def pipeline_wrap(module: Any) -> Any:
    cls = module.__class__
    new_cls = cls_to_pipeline_cls.get(cls)
    if not new_cls:
        dct = {"__deepcopy__": _unimplemented_deepcopy}
        new_cls = type(f"Pipeline{cls.__name__}", (PipelineModule, cls), dct)
        cls_to_pipeline_cls[cls] = new_cls
    module.__class__ = new_cls
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("pipeline_wrap does not support deepcopy")


class PipelineModule:
    pass
