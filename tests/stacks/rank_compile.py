"""torch.compile of a sharded reward model: compiled equals eager.

    torchrun --nproc-per-node 2 tests/stacks/rank_compile.py BACKEND [BACKEND ...]

For each backend (``eager``, ``aot_eager``: the ones that need no C++ toolchain), two sharded
copies of the same weights, one compiled, train side by side with an unsharded copy; the losses
and the scores afterwards must agree. One launch for all backends: starting the ranks costs more
than a tiny model's compilation.
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


def main(argv: list[str]) -> None:
    import copy

    import torch
    from torch._dynamo.utils import counters

    mesh = init_mesh()
    for backend in argv:
        torch._dynamo.reset()
        counters.clear()
        reference = build()
        eager = shard(copy.deepcopy(reference), mesh)
        compiled_model = shard(copy.deepcopy(reference), mesh)
        sharded = is_sharded(eager) and is_sharded(compiled_model)
        compiled = torch.compile(compiled_model, backend=backend)
        nets = (reference, eager, compiled)
        optimizers = [torch.optim.AdamW(net.parameters(), lr=1e-2) for net in nets]
        reference_losses, eager_losses, losses = (
            train(net, optimizer, range(STEPS)) for net, optimizer in zip(nets, optimizers))
        emit(
            case="compile",
            backend=backend,
            wrapper=wrapper_facts(compiled_model),
            sharded=sharded,
            compiled_type=type(compiled).__name__,
            # Graphs dynamo captured: zero would mean everything ran eagerly.
            graphs=counters["stats"]["unique_graphs"],
            losses=losses,
            eager_losses=eager_losses,
            reference_losses=reference_losses,
            compiled_vs_eager=max_difference(losses, eager_losses),
            eager_vs_reference=max_difference(eager_losses, reference_losses),
            scores_compiled_vs_eager=max_difference(scores(compiled), scores(eager)),
        )


if __name__ == "__main__":
    sys.exit(run(main))
