"""PEFT LoRA on a sequence-classification reward model, sharded as PEFT users shard it.

    torchrun --nproc-per-node 2 tests/stacks/rank_peft.py

The units are the decoder layers and the ``PeftModel`` itself (what accelerate's FSDP2 path does
with a PEFT model): PEFT's ``BaseTuner.forward`` calls ``self.model.forward`` directly, so a unit
made of the inner transformers model would never see FSDP's hooks. LoRA adapters train next to an
unsharded PEFT copy. Then, as a second layout, the inner transformers model (the class with the
ABC base) is sharded as its own unit too, which is where the layout error, or with the patch the
hook bypass, shows.
"""

from __future__ import annotations

import sys
from typing import Any

from rank_common import (
    build,
    emit,
    error_text,
    init_mesh,
    is_sharded,
    max_difference,
    run,
    scores,
    train,
    wrapper_facts,
)

STEPS = 2


def lora(model: Any) -> Any:
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(model, config)


def adapters(model: Any) -> dict[str, Any]:
    """The trainable (LoRA and score head) weights, gathered to full tensors on every rank."""
    from rank_common import full_tensor

    return {name: full_tensor(parameter.detach()) for name, parameter in model.named_parameters()
            if parameter.requires_grad}


def main(argv: list[str]) -> None:
    import copy

    import torch
    from torch.distributed.fsdp import fully_shard

    mesh = init_mesh()
    model = lora(build())
    reference = copy.deepcopy(model)
    inner = model.base_model.model  # the transformers model, whose class has the ABC base
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = is_sharded(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    reference_optimizer = torch.optim.AdamW(
        [p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    losses = train(model, optimizer, range(STEPS))
    reference_losses = train(reference, reference_optimizer, range(STEPS))
    trained, expected = adapters(model), adapters(reference)
    result = dict(
        case="peft",
        wrapper=wrapper_facts(model),
        inner_class=type(inner).__name__,
        layer_wrapper=type(inner.model.layers[0]).__name__,
        sharded=sharded,
        trainable=len(trainable),
        adapter_keys_equal=sorted(trained) == sorted(expected),
        adapters_vs_reference=max(max_difference(trained[k], expected[k]) for k in expected),
        losses=losses,
        reference_losses=reference_losses,
        trained_vs_reference=max_difference(losses, reference_losses),
        scores_vs_reference=max_difference(scores(model), scores(reference)),
    )

    # The other layout: the inner transformers model as a unit of its own.
    other = lora(build())
    other_inner = other.base_model.model
    for layer in other_inner.model.layers:
        fully_shard(layer, mesh=mesh)
    try:
        fully_shard(other_inner, mesh=mesh)
        fully_shard(other, mesh=mesh)
    except TypeError as error:
        result["inner_unit"] = {"sharded": False, "error": error_text(error)}
    else:
        try:
            scores(other)
            result["inner_unit"] = {"sharded": True, "forward": None}
        except Exception as error:
            result["inner_unit"] = {"sharded": True, "forward": error_text(error)}
    emit(**result)


if __name__ == "__main__":
    sys.exit(run(main))
