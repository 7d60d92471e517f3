"""One rank of a two-rank training job, for tests/test_processes.py: import as a training script
does, shard each affected transformers head, train it next to an unsharded copy, and print one
JSON line per head with the rank's status.

    python tests/programs/rank_step.py        # under torchrun, or with RANK, WORLD_SIZE, MASTER_* set

``LAUNCHER`` in the environment names what started it; tests/programs/launch.py calls ``start`` instead.
``TRAINING_SCRIPT_LOGGING=basicConfig``: configure logging at INFO first, as many training scripts do.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the one list of heads
from harness import AFFECTED


def run(launcher: str) -> None:
    if os.environ.get("TRAINING_SCRIPT_LOGGING") == "basicConfig":  # as training scripts start
        import logging

        logging.basicConfig(level=logging.INFO)
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401

    import fsdp_autopatch
    from fsdp_autopatch import _verify

    mesh = _verify.init_process_group()
    try:
        results = [_verify.shard_and_train(kind, mesh) for kind in AFFECTED]
        dist.barrier()  # no rank tears gloo down while another still uses it
    finally:
        dist.destroy_process_group()
    status = fsdp_autopatch.status().to_dict()
    for result in results:
        print(json.dumps({**result, "launcher": launcher, "rank": int(os.environ["RANK"]),
                          "pid": os.getpid(), "status": status}), flush=True)


def start(rank: int, world: int, port: int, launcher: str) -> None:
    """multiprocessing target: the rank's place in the group, then the same run."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    run(launcher)


if __name__ == "__main__":
    run(os.environ["LAUNCHER"])
