"""torch.distributed.checkpoint round trip of a sharded reward model, model and optimizer state.

    torchrun --nproc-per-node 2 tests/stacks/rank_dcp.py CHECKPOINT_DIR

Trains a sharded sequence-classification model next to an unsharded copy, saves model and AdamW
state with ``dcp.save``, loads them into a sharded model built from other weights, and checks that
the restored model answers like the saved one and keeps training like it (Adam's moments matter).
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
LEARNING_RATE = 1e-2


def main(argv: list[str]) -> None:
    import copy

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    (directory,) = argv
    mesh = init_mesh()
    model = build()
    reference = copy.deepcopy(model)
    shard(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LEARNING_RATE)
    losses = train(model, optimizer, range(STEPS))
    reference_losses = train(reference, reference_optimizer, range(STEPS))

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory)

    # Other weights and an empty optimizer: everything that matches afterwards came from the files.
    restored = shard(build(seed=1), mesh)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=LEARNING_RATE)
    before_load = scores(restored)
    model_state, optimizer_state = get_state_dict(restored, restored_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(restored, restored_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])

    saved_scores, restored_scores, reference_scores = scores(model), scores(restored), scores(reference)
    # One more AdamW step on each: equal only if the optimizer state was restored too.
    next_step = range(STEPS, STEPS + 1)
    next_restored = train(restored, restored_optimizer, next_step)
    next_saved = train(model, optimizer, next_step)
    train(reference, reference_optimizer, next_step)
    emit(
        case="dcp",
        wrapper=wrapper_facts(restored),
        sharded=is_sharded(model) and is_sharded(restored),
        losses=losses,
        reference_losses=reference_losses,
        trained_vs_reference=max_difference(losses, reference_losses),
        differed_before_load=max_difference(before_load, saved_scores),
        restored_vs_saved=max_difference(restored_scores, saved_scores),
        saved_vs_reference=max_difference(saved_scores, reference_scores),
        next_step_restored_vs_saved=max_difference(next_restored, next_saved),
        after_step_restored_vs_saved=max_difference(scores(restored), scores(model)),
        after_step_vs_reference=max_difference(scores(reference), scores(model)),
    )


if __name__ == "__main__":
    sys.exit(run(main))
