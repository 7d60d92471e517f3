"""Megatron-FSDP's experimental ``fully_shard`` on the CPU, as a training script calls it.

    python tests/programs/megatron_wrap.py

On a 1-rank gloo group and a CPU mesh, wraps a transformers sequence-classification head (its
decoder layers, then the root), a user's ``class (abc.ABC, nn.Linear)``, and two plain
``nn.Linear`` modules. Prints one JSON object: what became of each, the classes the plain
modules got (bases, namespace, one class per call), and the status. The forward needs CUDA
(``megatron_fsdp/experimental/module.py``): tests/programs/megatron_train.py trains where a GPU is.
"""

from __future__ import annotations

import abc
import json
import sys
from typing import Any

import megatron_fsdp.experimental as megatron
import torch
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_autopatch
from fsdp_autopatch import _verify

# What type() and a class statement put in every class: not the builder's namespace.
CLASS_METADATA = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__firstlineno__",
                  "__static_attributes__", "_abc_impl"}


def wrap(module: nn.Module, mesh: Any, placements: Any) -> str:
    try:
        megatron.fully_shard(module, mesh, placements)
    except TypeError as error:
        return "layout" if _verify.LAYOUT_ERROR in str(error) else f"TypeError: {error}"
    return "wrapped"


def described(module: nn.Module, original: type) -> dict[str, Any]:
    cls = type(module)
    return {"name": cls.__name__, "module": cls.__module__, "bases": [b.__name__ for b in cls.__bases__],
            "torch_shape": cls.__bases__ == (megatron.fully_shard.__globals__["FsdpModule"], original),
            "namespace": sorted(set(vars(cls)) - CLASS_METADATA)}


def main() -> int:
    _verify.init_process_group()
    mesh = init_device_mesh("cpu", (1,))
    flat = [megatron.Flat()]
    placements = megatron.Placements(dp_axes=[0], parameter=flat, gradient=flat, optimizer=flat)
    head = transformers.Qwen2ForSequenceClassification(_verify.tiny_config())
    layers = {wrap(layer, mesh, placements) for layer in head.model.layers}
    report: dict[str, Any] = {"layers": sorted(layers)}
    report["head"] = wrap(head, mesh, placements)

    class UserHead(abc.ABC, nn.Linear):
        pass

    report["user_head"] = wrap(UserHead(2, 2), mesh, placements)
    plain = [nn.Linear(2, 2), nn.Linear(2, 2)]
    report["plain"] = [wrap(module, mesh, placements) for module in plain]
    report["plain_classes"] = [described(module, nn.Linear) for module in plain]
    report["one_class_per_call"] = type(plain[0]) is not type(plain[1])
    wrapper = megatron.fully_shard.__globals__["FsdpModule"]
    report["head_class"] = {
        "first_base": type(head).__bases__[0].__name__, "is_fsdp_module": isinstance(head, wrapper),
        "original_at_2": type(head).__mro__[2] is transformers.Qwen2ForSequenceClassification,
    }
    status = fsdp_autopatch.status()
    report["status"] = {"applied": status.applied, "sites": list(status.sites),
                        "classes": sorted({(r.name, r.outcome) for r in status.classes
                                           if r.site.startswith("megatron_fsdp")})}
    print(json.dumps(report, sort_keys=True))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
