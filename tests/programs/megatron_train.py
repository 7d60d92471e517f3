"""Megatron-FSDP's experimental ``fully_shard`` training an affected head, where a GPU is.

    python tests/programs/megatron_train.py           # exit 0: wrapped and trained like its unwrapped copy
    FSDP_AUTOPATCH=0 python tests/programs/megatron_train.py   # exit 1: the layout error, unfixed

Needs CUDA (Megatron-FSDP's forward runs on CUDA streams); exit 2 where there is none. One
process, a 1-rank NCCL group: a transformers sequence-classification head, its decoder layers
then its root wrapped, trained for a few steps with Megatron-FSDP's optimizer hooks beside an
unwrapped copy of the same weights. Prints one JSON object (tests/test_megatron.py reads it).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

STEPS = 3
LEARNING_RATE = 1e-2
EXIT_TRAINED, EXIT_LAYOUT, EXIT_CANNOT_RUN = 0, 1, 2


def report(**fields: Any) -> None:
    print(json.dumps(fields, sort_keys=True), flush=True)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        report(trained=False, error="no CUDA device: Megatron-FSDP's forward needs one")
        return EXIT_CANNOT_RUN
    import megatron_fsdp.experimental as megatron
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_autopatch import _verify

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_verify.free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    flat = [megatron.Flat()]
    placements = megatron.Placements(dp_axes=[0], parameter=flat, gradient=flat, optimizer=flat)
    torch.manual_seed(0)
    reference = transformers.Qwen2ForSequenceClassification(_verify.tiny_config()).cuda()
    model = copy.deepcopy(reference)
    try:
        for layer in model.model.layers:
            megatron.fully_shard(layer, mesh, placements)
        megatron.fully_shard(model, mesh, placements)
    except TypeError as error:
        report(trained=False, error=str(error))
        return EXIT_LAYOUT if _verify.LAYOUT_ERROR in str(error) else EXIT_CANNOT_RUN
    optimizers = [torch.optim.SGD(net.parameters(), lr=LEARNING_RATE) for net in (reference, model)]
    megatron.fully_shard_optimizer(optimizers[1])
    differences = []
    for step in range(STEPS):
        batch = _verify.make_batch("sequence-classification", step)
        batch = {key: value.cuda() for key, value in batch.items()}
        losses = []
        for net, optimizer in zip((reference, model), optimizers):
            optimizer.zero_grad()
            loss = net(**batch).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        differences.append(abs(losses[0] - losses[1]))
    report(trained=max(differences) < _verify.LOSS_TOLERANCE, max_loss_difference=max(differences),
           wrapper=type(model).__name__)
    dist.destroy_process_group()
    return EXIT_TRAINED if max(differences) < _verify.LOSS_TOLERANCE else EXIT_CANNOT_RUN


if __name__ == "__main__":
    sys.exit(main())
