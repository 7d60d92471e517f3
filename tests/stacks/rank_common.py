"""What every rank-side script of the stacks tests shares (runs under torchrun, one per rank).

The scripts run as ``python -m torch.distributed.run --standalone --nproc-per-node 2
tests/stacks/rank_<case>.py ...`` so that the installed ``fsdp_autopatch.pth`` is what patches each
rank, exactly as for a user. Rank 0 prints JSON lines on stdout; the pytest side compares them.

A framework call that raises is reported as ``{"error": ...}`` (with the exception's type and
first line) and the rank exits 0: with ``FSDP_AUTOPATCH=0`` the layout error *is* the expected
result, and both ranks raise it at the same point, before any collective could hang.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable, Iterable

# The package's own proof builds the same tiny models; its module imports only the standard library.
from fsdp_autopatch import _verify

VOCABULARY = _verify.VOCABULARY
BATCH, SEQUENCE = 4, 8


def tiny_config(**overrides: Any) -> Any:
    """The two-layer Qwen2 config of ``fsdp_autopatch._verify`` (seconds to build and train on a
    CPU, no download) as a reward model's, one score per sequence; then ``overrides``."""
    config = _verify.tiny_config()
    config.update({
        "num_labels": 1,
        # No dropout anywhere, so the sharded and unsharded copies compute the same numbers.
        "attention_dropout": 0.0,
        # Activation checkpointing with Qwen2's default use_cache=True fails; training needs no cache.
        "use_cache": False,
        **overrides,
    })
    return config


def batch(step: int) -> dict[str, Any]:
    """A reward model's batch (one score per sequence, so regression targets), the same on every
    rank: the averaged gradients of the sharded model then equal the unsharded model's."""
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCABULARY, (BATCH, SEQUENCE), generator=generator)
    target = torch.randn(BATCH, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": target}


def train(model: Any, optimizer: Any, steps: Iterable[int]) -> list[float]:
    """Plain training steps on :func:`batch`; the losses."""
    losses = []
    for step in steps:
        loss = model(**batch(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def scores(model: Any, step: int = 99) -> list[Any]:
    """The model's logits on a batch no training step saw, as nested lists."""
    import torch

    with torch.no_grad():
        return model(**batch(step)).logits.tolist()


def init_mesh() -> Any:
    """The gloo group torchrun described, as a one-dimensional CPU device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return init_device_mesh("cpu", (dist.get_world_size(),))


def select_fsdp(plugin: Any) -> None:
    """Put accelerate on its FSDP path, which it never selects on a CPU by itself.

    accelerate 1.10 leaves ``distributed_type`` at ``MULTI_CPU`` whatever the plugin says, and
    would wrap the model in DDP. On GPUs it sets FSDP in both shared states and keeps the plugin;
    this does exactly that, so ``prepare()`` runs ``_prepare_fsdp2`` -> ``fsdp2_prepare_model``.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def emit(**fields: Any) -> None:
    """One JSON line from rank 0."""
    if rank() == 0:
        print(json.dumps(fields, default=str), flush=True)


def patch_status() -> dict[str, Any]:
    """What the installed package did in this rank (importing it applies nothing)."""
    import fsdp_autopatch

    return fsdp_autopatch.status().to_dict()


def error_text(error: BaseException) -> str:
    """The exception and its causes, one line each: frameworks re-raise torch's TypeError."""
    lines = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        first = str(current).strip().splitlines()
        lines.append(f"{type(current).__name__}: {first[0] if first else ''}")
        current = current.__cause__ or current.__context__
    return " <- ".join(lines)


def max_difference(first: Any, second: Any) -> float:
    """Largest absolute difference between two tensors, or two lists of numbers."""
    import torch

    a = torch.as_tensor(first, dtype=torch.float64)
    b = torch.as_tensor(second, dtype=torch.float64)
    return float((a - b).abs().max()) if a.numel() else 0.0


def full_tensor(value: Any) -> Any:
    """A DTensor gathered to a plain tensor (every rank must call it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def build(head: str = "AutoModelForSequenceClassification", seed: int = 0, **overrides: Any) -> Any:
    """A tiny transformers model from a config, the same weights on every rank."""
    import torch
    import transformers

    torch.manual_seed(seed)
    return getattr(transformers, head).from_config(tiny_config(**overrides))


def shard(model: Any, mesh: Any, **options: Any) -> Any:
    """FSDP2 the way the frameworks do it: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def wrapper_facts(module: Any) -> dict[str, Any]:
    """The class fully_shard built: its name, and whether it is torch's own construction."""
    from torch.distributed.fsdp import FSDPModule

    return {"name": type(module).__name__, "is_fsdp_module": isinstance(module, FSDPModule)}


def is_sharded(module: Any) -> bool:
    """True when ``module`` went through fully_shard: once resharded, its parameters are DTensors.

    The root stays unsharded after a forward pass (torch does not reshard it), hence the reshard.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(module, FSDPModule):
        return False
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
    return all(isinstance(parameter, DTensor) for parameter in module.parameters())


def run(main: Callable[[list[str]], None], argv: Iterable[str] | None = None) -> int:
    """Run ``main`` on this rank; report its exception as the case's result instead of crashing."""
    import torch.distributed as dist

    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        main(arguments)
        if dist.is_initialized():
            # Both ranks done before either tears gloo down: a rank that exits while its peer
            # still has gloo work pending can abort at exit ("terminate called without an active
            # exception"), unpatched torch alike.
            dist.barrier()
    except Exception as error:
        emit(error=error_text(error))
        if os.environ.get("STACKS_TRACEBACK"):
            traceback.print_exc()
    finally:
        # After the case, when torch's FSDP2 and transformers are both imported: the patch's
        # decision is made by then.
        emit(status=patch_status())
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
