"""verl's own FSDP2 wrapping (``verl.utils.fsdp_utils.apply_fsdp2``) of a critic, a reward model and
of models holding a user's head with an empty-``__slots__`` first base.

    torchrun --nproc-per-node 2 tests/stacks/rank_verl.py shipped|noop

verl wraps every ``fully_shard`` call in its ``maybe_patch_fsdp_module``, which rebinds torch's
``FSDPModule`` to ``class FSDPModuleABC(ABC, FSDPModule)`` for modules that are ``abc.ABC``
instances. ``shipped`` keeps that manager; ``noop`` replaces it with a no-op, so that only
fsdp-autopatch (or nothing, under ``FSDP_AUTOPATCH=0``) stands between torch and the layout error.
Each model trains 2 steps with verl's ``fsdp2_clip_grad_norm_`` next to an unsharded copy; one
JSON line per model.
"""

from __future__ import annotations

import abc
import contextlib
import sys
import typing
from typing import Any, Iterator

from rank_common import VOCABULARY, emit, error_text, init_mesh, is_sharded, max_difference, run, tiny_config

STEPS = 2
T = typing.TypeVar("T")
MODELS = ("critic", "reward-model", "abc-head", "generic-head")


def heads() -> dict[str, type]:
    from torch import nn

    class AbcValueHead(abc.ABC, nn.Module):
        """A user's value head with an abc.ABC base first."""

        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.linear = nn.Linear(hidden, 1)

        def forward(self, hidden_states: Any) -> Any:
            return self.linear(hidden_states)

    class GenericValueHead(typing.Generic[T], nn.Module):
        """The same head with a typing.Generic[T] base first."""

        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.linear = nn.Linear(hidden, 1)

        def forward(self, hidden_states: Any) -> Any:
            return self.linear(hidden_states)

    return {"abc-head": AbcValueHead, "generic-head": GenericValueHead}


def build(kind: str) -> Any:
    """The model verl would shard for ``kind``, from a config (classifier_dropout=0.0, as verl sets)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = tiny_config(num_labels=1)
    if kind == "critic":
        return transformers.AutoModelForTokenClassification.from_config(config)
    if kind == "reward-model":
        return transformers.AutoModelForSequenceClassification.from_config(config)
    # A causal LM (no ABC) whose lm_head is replaced by the user's head: the ABC module is
    # not the root, and is sharded as a unit of its own.
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.lm_head = heads()[kind](config.hidden_size)
    return model


def values(model: Any, step: int) -> tuple[Any, Any]:
    """Per-token (critic, user heads) or per-sequence (reward model) values and random targets."""
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCABULARY, (4, 8), generator=generator)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.squeeze(-1)
    return out, torch.randn(out.shape, generator=generator)


def train(model: Any, steps: range, clip: Any) -> list[float]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in steps:
        out, target = values(model, step)
        loss = ((out - target) ** 2).mean()
        loss.backward()
        clip(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@contextlib.contextmanager
def no_manager(module: Any) -> Iterator[None]:
    yield


def main(argv: list[str]) -> None:
    import copy

    import torch
    from verl.utils import fsdp_utils

    (manager,) = argv
    if manager == "noop":
        fsdp_utils.maybe_patch_fsdp_module = no_manager
    mesh = init_mesh()
    for kind in MODELS:
        model = build(kind)
        reference = copy.deepcopy(model)
        head = None if kind in ("critic", "reward-model") else model.lm_head
        wrap = ["Qwen2DecoderLayer"] + ([type(head).__name__] if head is not None else [])
        result: dict[str, Any] = {"case": "verl", "model": kind, "manager": manager}
        try:
            # verl reads only wrap_policy.transformer_layer_cls_to_wrap from its config here.
            config = {"wrap_policy": {"transformer_layer_cls_to_wrap": wrap}}
            fsdp_utils.apply_fsdp2(model, {"mesh": mesh}, config)
        except TypeError as error:
            emit(**result, sharded=False, error=error_text(error))
            continue
        unit = head if head is not None else model
        losses = train(model, range(STEPS), fsdp_utils.fsdp2_clip_grad_norm_)
        reference_losses = train(reference, range(STEPS), torch.nn.utils.clip_grad_norm_)
        emit(
            **result,
            sharded=is_sharded(model),
            unit=type(unit).__name__,
            # verl's manager builds (FSDPModuleABC, cls); torch and fsdp-autopatch build
            # (FSDPModule or its compatible subclass, cls).
            unit_bases=[base.__name__ for base in type(unit).__bases__],
            losses=losses,
            reference_losses=reference_losses,
            trained_vs_reference=max_difference(losses, reference_losses),
        )


if __name__ == "__main__":
    sys.exit(run(main))
