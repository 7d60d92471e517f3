"""accelerate's own FSDP2 preparation of a reward model: train, full state dict, save, reload.

    torchrun --nproc-per-node 2 tests/stacks/rank_accelerate.py SAVE_DIR

accelerate 1.10 never selects FSDP on a CPU: with an FSDP2 plugin it leaves ``distributed_type``
at ``MULTI_CPU`` and wraps the model in DDP. Its real FSDP2 path (``prepare`` ->
``_prepare_fsdp2`` -> ``fsdp2_prepare_model``, which calls ``fully_shard`` on every decoder layer
and the root) runs once ``distributed_type`` says FSDP, which is what it says on GPUs; so that is
set here, and nothing else of accelerate is touched.
"""

from __future__ import annotations

import sys

from rank_common import (
    batch,
    build,
    emit,
    init_mesh,
    is_sharded,
    max_difference,
    run,
    scores,
    select_fsdp,
    train,
    wrapper_facts,
)

STEPS = 3


def fsdp2_accelerator() -> object:
    """An Accelerator on accelerate's FSDP2 path, on a CPU."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Qwen2DecoderLayer"], state_dict_type="FULL_STATE_DICT",
        reshard_after_forward=True, cpu_ram_efficient_loading=False,
    )
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    select_fsdp(plugin)
    assert accelerator.is_fsdp2
    return accelerator


def main(argv: list[str]) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    (directory,) = argv
    init_mesh()
    accelerator = fsdp2_accelerator()
    model = build()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)  # type: ignore[attr-defined]
    sharded = is_sharded(model)
    layer_wrapper = type(model.base_model.layers[0]).__name__
    losses = []
    for step in range(STEPS):
        loss = model(**batch(step)).loss
        accelerator.backward(loss)  # type: ignore[attr-defined]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    reference_losses = train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), range(STEPS))

    full = accelerator.get_state_dict(model)  # type: ignore[attr-defined]
    expected = reference.state_dict()
    state_keys_equal = sorted(full) == sorted(expected)
    state_vs_reference = max(max_difference(full[key], expected[key]) for key in expected) if \
        state_keys_equal and dist.get_rank() == 0 else 0.0
    accelerator.save_model(model, directory)  # type: ignore[attr-defined]
    if dist.get_rank() == 0:
        reference.config.save_pretrained(directory)
    dist.barrier()
    reloaded = AutoModelForSequenceClassification.from_pretrained(directory)
    emit(
        case="accelerate",
        distributed_type=str(accelerator.distributed_type),  # type: ignore[attr-defined]
        wrapper=wrapper_facts(model),
        layer_wrapper=layer_wrapper,
        sharded=sharded,
        losses=losses,
        reference_losses=reference_losses,
        trained_vs_reference=max_difference(losses, reference_losses),
        # get_state_dict gathers full tensors on rank 0 (other ranks get an empty dict).
        state_keys_equal=state_keys_equal,
        state_vs_reference=state_vs_reference,
        reloaded_vs_reference=max_difference(scores(reloaded), scores(reference)),
        sharded_vs_reference=max_difference(scores(model), scores(reference)),
    )


if __name__ == "__main__":
    sys.exit(run(main))
