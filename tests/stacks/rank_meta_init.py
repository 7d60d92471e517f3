"""Meta-device construction of a sharded reward model: fully_shard, to_empty, re-initialise, train.

    torchrun --nproc-per-node 2 tests/stacks/rank_meta_init.py

The way large reward models are built: no memory until sharded. After ``to_empty`` every tensor
is uninitialised memory, so the weights are loaded from a full state dict broadcast from rank 0,
and the rotary ``inv_freq`` buffers (not part of the state dict) are recomputed, as users must.
The model then trains like an unsharded copy of the same weights.
"""

from __future__ import annotations

import sys

from rank_common import (
    build,
    emit,
    init_mesh,
    is_sharded,
    max_difference,
    run,
    scores,
    shard,
    train,
    wrapper_facts,
)

STEPS = 2


def recompute_rotary(model: object) -> int:
    """Recompute every rotary embedding's ``inv_freq`` buffer; how many were recomputed."""
    import torch

    count = 0
    for module in model.modules():  # type: ignore[attr-defined]
        if hasattr(module, "rope_init_fn") and hasattr(module, "inv_freq"):
            inv_freq, _ = module.rope_init_fn(module.config, torch.device("cpu"))
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq = module.inv_freq
            count += 1
    return count


def main(argv: list[str]) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    mesh = init_mesh()
    reference = build()  # the weights rank 0 would have read from disk
    with torch.device("meta"):
        model = build()
    on_meta = all(parameter.is_meta for parameter in model.parameters())
    shard(model, mesh)
    model.to_empty(device="cpu")
    set_model_state_dict(
        model, reference.state_dict(),
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    rotary = recompute_rotary(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    initial = max_difference(scores(model), scores(reference))
    losses = train(model, optimizer, range(STEPS))
    reference_losses = train(reference, reference_optimizer, range(STEPS))
    emit(
        case="meta-init",
        built_on_meta=on_meta,
        wrapper=wrapper_facts(model),
        sharded=is_sharded(model),
        rotary_recomputed=rotary,
        initial_vs_reference=initial,
        losses=losses,
        reference_losses=reference_losses,
        trained_vs_reference=max_difference(losses, reference_losses),
        after_vs_reference=max_difference(scores(model), scores(reference)),
    )


if __name__ == "__main__":
    sys.exit(run(main))
