"""A launcher with torch loaded (as torch.multiprocessing users have) but not FSDP2, for
tests/test_processes.py: starts the ranks of tests/programs/rank_step.py and reports their exit codes.

    python tests/programs/launch.py spawn|fork|subprocess WORLD PORT
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import rank_step
import torch  # noqa: F401


def main(method: str, world: int, port: int) -> int:
    if method in ("spawn", "fork"):
        context = multiprocessing.get_context(method)
        ranks = [context.Process(target=rank_step.start, args=(rank, world, port, method))
                 for rank in range(world)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
        codes = [process.exitcode for process in ranks]
    else:
        children = [
            subprocess.Popen([sys.executable, rank_step.__file__], env={
                **os.environ, "LAUNCHER": method, "RANK": str(rank), "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in range(world)
        ]
        codes = [child.wait() for child in children]
    import fsdp_autopatch

    print(json.dumps({"launcher": "parent", "pid": os.getpid(), "codes": codes,
                      "status": fsdp_autopatch.status().to_dict()}), flush=True)
    return max(abs(code) for code in codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
