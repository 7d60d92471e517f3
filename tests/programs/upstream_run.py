"""One rank, for tests/test_upstream.py: wrap models through each of torch's three calls that swap
a module's class, train each next to an unwrapped copy, and print one JSON line per call and
model, then one line with the package's status and whether torch's builder code was left alone.

    python tests/programs/upstream_run.py        # under torchrun (two ranks)

The models: the three affected transformers heads and a causal LM (their tiny configs), a user's
``Generic[T]``-first module, an ``ABC``-last one and a plain one.
"""

from __future__ import annotations

import abc
import copy
import importlib
import json
import sys
import typing
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.fsdp
import transformers  # noqa: F401 (what arms the package where the bug is)
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp2_replicate

import fsdp_autopatch
from fsdp_autopatch import _sites, _verify

T = typing.TypeVar("T")


class GenericFirst(typing.Generic[T], nn.Linear):
    pass


class AbcLast(nn.Linear, abc.ABC):
    pass


class Plain(nn.Linear):
    pass


USERS_OWN = {"generic-first": GenericFirst, "abc-last": AbcLast, "plain": Plain}


def builders() -> dict[str, Any]:
    """The code object of every builder function of ``_sites`` this process has imported."""
    return {f"{site.builder_module}.{site.builder}":
            getattr(sys.modules[site.builder_module], site.builder).__code__
            for site in _sites.SITES if hasattr(sys.modules.get(site.builder_module), site.builder)}


def build(model: str) -> tuple[nn.Module, Callable[[nn.Module, int], torch.Tensor]]:
    """The model, and its loss for a step."""
    if model in USERS_OWN:
        torch.manual_seed(0)
        module = USERS_OWN[model](4, 4)

        def loss(net: nn.Module, step: int) -> torch.Tensor:
            inputs = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            return net(inputs).square().mean()

        return module, loss
    return _verify.build_model(model), lambda net, step: net(**_verify.make_batch(model, step)).loss


def main() -> None:
    mesh = _verify.init_process_group()
    code_before = builders()
    calls: dict[str, Callable[[nn.Module], Any]] = {
        _sites.FULLY_SHARD: lambda module: torch.distributed.fsdp.fully_shard(module, mesh=mesh),
        _sites.FSDP2_REPLICATE: lambda module: fsdp2_replicate(module, mesh=mesh),
        # the module's function (torch.distributed._composable exports one of that name too)
        _sites.DDP_REPLICATE: importlib.import_module(_sites.DDP_MODULE).replicate,
    }
    for api, wrap in calls.items():
        for model in (*_verify.MODELS, *USERS_OWN):
            net, loss_of = build(model)
            original, reference = type(net), copy.deepcopy(net)
            result: dict[str, Any] = {"api": api, "model": model}
            try:
                if api != _sites.DDP_REPLICATE and hasattr(net, "base_model"):
                    for layer in net.base_model.layers:
                        wrap(layer)
                wrap(net)
            except TypeError as error:
                print(json.dumps({**result, "wrapped": False, "error": str(error)}), flush=True)
                continue
            differences = []
            optimizers = {each: torch.optim.SGD(each.parameters(), lr=0.1) for each in (net, reference)}
            for step in range(2):
                losses = []
                for each, optimizer in optimizers.items():
                    loss = loss_of(each, step)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    losses.append(loss.item())
                differences.append(abs(losses[0] - losses[1]))
            print(json.dumps({**result, "wrapped": True, "class": _verify.describe_class(type(net)),
                              # where the wrapper's __new__ (and dynamo) look for the original
                              "original_at_its_index": type(net).__mro__[
                                  getattr(type(net), "_orig_cls_mro_index", 2)] is original,
                              "max_loss_difference": max(differences)}), flush=True)
    status = fsdp_autopatch.status()
    code_after = builders()
    untouched = code_after.keys() == code_before.keys() and all(
        code_after[name] is code for name, code in code_before.items())
    print(json.dumps({"status": status.to_dict(), "rank": dist.get_rank(), "builders_untouched": untouched}),
          flush=True)
    # No rank tears gloo down while another still uses it (gloo aborts the process then).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
