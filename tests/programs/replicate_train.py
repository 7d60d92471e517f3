"""One rank, for tests/test_replicate.py: the imports in the order given, then FSDP2's
``replicate`` on every decoder layer and the root of each model, trained next to an unsharded
copy. Prints the patch's status line, then one JSON line per model.

    python tests/programs/replicate_train.py IMPORTS KIND...    # IMPORTS as import_order.py reads them
"""

import abc
import copy
import json
import sys

from import_order import import_modules

import_modules(sys.argv[1])

import torch  # noqa: E402 (after the imports under test)
import torch.distributed as dist  # noqa: E402
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate  # noqa: E402

import fsdp_autopatch  # noqa: E402
from fsdp_autopatch import _verify  # noqa: E402

mesh = _verify.init_process_group()
print(json.dumps({"status": fsdp_autopatch.status().to_dict()}), flush=True)
for kind in sys.argv[2:]:
    model = _verify.build_model(kind)
    original = type(model)
    reference = copy.deepcopy(model)
    result = {"model": kind, "abc_in_mro": abc.ABC in original.__mro__}
    try:
        for layer in model.base_model.layers:
            replicate(layer, mesh=mesh)
        replicate(model, mesh=mesh)
    except TypeError as error:
        result.update(replicated=False, error=str(error))
        print(json.dumps(result), flush=True)
        continue
    losses = {model: [], reference: []}
    optimizers = {net: torch.optim.SGD(net.parameters(), lr=0.1) for net in losses}
    for step in range(2):
        for net, optimizer in optimizers.items():
            loss = net(**_verify.make_batch(kind, step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[net].append(loss.item())
    wrapper = type(model)
    result.update(
        replicated=True,
        wrapper=_verify.describe_class(wrapper),
        upstream_bases=wrapper.__bases__ == (ReplicateModule, original),
        is_replicate_module=isinstance(model, ReplicateModule),
        original_at_mro_3=wrapper.__mro__[3] is original,
        layer_wrapper=type(model.base_model.layers[0]).__name__,
        max_loss_difference=max(abs(a - b) for a, b in zip(losses[model], losses[reference])),
    )
    print(json.dumps(result), flush=True)
dist.destroy_process_group()
