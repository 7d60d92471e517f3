"""Two Ray actors form a gloo group and shard a transformers sequence-classification head with
FSDP2, as verl, OpenRLHF and NeMo-RL run their FSDP workers: each actor sets its RANK and
LOCAL_RANK in ``__init__``, after its interpreter started. For tests/stacks/test_ray.py; prints
one JSON line: each actor's result and status, and the driver's stderr lines are the test's.

    python tests/stacks/ray_job.py [--off] [--pythonpath DIR]
                       # --off: FSDP_AUTOPATCH=0 through runtime_env; DIR: ahead on the actors' path

Runs a local Ray cluster of its own (no dashboard), on the CPU.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import ray


@ray.remote(num_cpus=1)
class Rank:
    def __init__(self, rank: int, world: int, port: int) -> None:
        # As the trainers set them: in the actor, after its interpreter started.
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def shard_and_train(self) -> dict:
        import torch.distributed as dist
        import torch.distributed.fsdp  # noqa: F401
        import transformers  # noqa: F401 (an affected release arms the patch)

        import fsdp_autopatch
        from fsdp_autopatch import _verify

        mesh = _verify.init_process_group()
        try:
            result = _verify.shard_and_train("sequence-classification", mesh)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        status = fsdp_autopatch.status()
        return {**result, "pid": os.getpid(), "applied": status.applied, "armed_by": status.armed_by,
                "mode": status.mode}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main(argv: list[str]) -> int:
    env_vars = {"FSDP_AUTOPATCH": "0"} if "--off" in argv else {}
    if "--pythonpath" in argv:
        env_vars["PYTHONPATH"] = argv[argv.index("--pythonpath") + 1]
    runtime_env = {"env_vars": env_vars} if env_vars else None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True, runtime_env=runtime_env)
    try:
        port = free_port()
        ranks = [Rank.remote(rank, 2, port) for rank in range(2)]
        results = ray.get([rank.shard_and_train.remote() for rank in ranks], timeout=600)
    finally:
        ray.shutdown()
    print(json.dumps({"ranks": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
