"""For made_up_site.py and made_up_api.py, once their rows are in the tables: wrap an ABC-first
module and a plain one through the made-up site, then print the one JSON line tests/test_sites.py
reads (the status, the classes built, the probe's answer and doctor's check)."""

import abc
import json
from typing import Any, Callable, Optional

import torch.nn

import fsdp_autopatch
from fsdp_autopatch import _patch


class Head(abc.ABC, torch.nn.Module):
    pass


class Plain(torch.nn.Module):
    pass


def wrap_and_report(wrap: Callable[[torch.nn.Module], Any], wrapper_cls: type,
                    resolve: Callable[[], Optional[_patch.Construction]], doctor: Callable[[], Any]) -> None:
    classes = {}
    for cls in (Head, Plain):
        module = cls()
        try:
            wrap(module)
        except TypeError as error:
            classes[cls.__name__] = {"error": str(error)}
        else:
            classes[cls.__name__] = {"name": type(module).__name__,
                                     "is_wrapper": isinstance(module, wrapper_cls),
                                     "torch_bases": type(module).__bases__ == (wrapper_cls, cls)}
    construction = resolve()
    print(json.dumps({
        "status": fsdp_autopatch.status().to_dict(),
        "classes": classes,
        "resolved": construction is not None,
        "probe": construction and _patch.probe(construction),
        "doctor": doctor(),
    }))
