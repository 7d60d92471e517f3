"""Every process of a training job runs patched, however it was started.

A job's ranks are started by torchrun, by multiprocessing (spawn or fork), or by a plain
subprocess. Each rank here joins a two-rank gloo group, shards an ABC-headed transformers model
and trains one step next to an unsharded copy. With ``FSDP_AUTOPATCH=0`` in the launcher's
environment, which every child inherits, no rank is patched and the layout error comes back.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import LAYOUT_ERROR, environment, json_lines, layout_bug_here
from harness import RANKS, torchrun

from fsdp_autopatch._verify import free_port

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 600

RANK_SCRIPT = '''
"""One rank: import as a training script does, shard, train a step, report one JSON line."""
import json
import os


def run(launcher):
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401

    import fsdp_autopatch
    from fsdp_autopatch import _verify

    mesh = _verify.init_process_group()
    try:
        result = _verify.shard_and_train("token-classification", mesh, steps=1)
    finally:
        dist.destroy_process_group()
    print(json.dumps({
        "launcher": launcher,
        "rank": int(os.environ["RANK"]),
        "pid": os.getpid(),
        "status": fsdp_autopatch.status().to_dict(),
        "sharded": result["sharded"],
        "error": result.get("error"),
        "losses": result.get("losses"),
        "max_loss_difference": result.get("max_loss_difference"),
    }), flush=True)


def start(rank, world, port, launcher):
    """multiprocessing target: the rank's place in the group, then the same run."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    run(launcher)


if __name__ == "__main__":
    run(os.environ["LAUNCHER"])
'''

LAUNCH_SCRIPT = '''
"""A launcher with torch loaded (as torch.multiprocessing users have) but not FSDP2."""
import json
import multiprocessing
import os
import subprocess
import sys

import torch  # noqa: F401

import rank_step


def main(method, world, port):
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
        ranks = [
            subprocess.Popen([sys.executable, rank_step.__file__], env={
                **os.environ, "LAUNCHER": method, "RANK": str(rank), "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in range(world)
        ]
        codes = [process.wait() for process in ranks]
    import fsdp_autopatch

    print(json.dumps({"launcher": "parent", "pid": os.getpid(), "codes": codes,
                      "status": fsdp_autopatch.status().to_dict()}), flush=True)
    return max(abs(code) for code in codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
'''


def launch(where: Path, launcher: str, **variables: Optional[str]) -> list[dict[str, Any]]:
    """Start a two-rank job with ``launcher``; the JSON lines its ranks (and launcher) printed."""
    (where / "rank_step.py").write_text(textwrap.dedent(RANK_SCRIPT))
    (where / "launch.py").write_text(textwrap.dedent(LAUNCH_SCRIPT))
    if launcher == "torchrun":
        result = torchrun(where / "rank_step.py", env=environment(LAUNCHER=launcher, **variables), cwd=where,
                          timeout=JOB_TIMEOUT)
    else:
        command = [sys.executable, str(where / "launch.py"), launcher, str(RANKS), str(free_port())]
        result = subprocess.run(command, capture_output=True, text=True, env=environment(**variables),
                                cwd=where, timeout=JOB_TIMEOUT, check=False)
    output = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, output
    lines = json_lines(result.stdout)
    ranks = sorted((line for line in lines if line["launcher"] == launcher), key=lambda line: line["rank"])
    assert [line["rank"] for line in ranks] == list(range(RANKS)), output
    assert len({line["pid"] for line in lines}) == len(lines), "each report comes from its own process"
    parents = [line for line in lines if line["launcher"] == "parent"]
    for parent in parents:
        assert parent["codes"] == [0] * RANKS, output
        # The launcher never imported FSDP2: whatever patched the ranks happened in the ranks.
        assert not parent["status"]["applied"], parent
    return ranks


@pytest.mark.parametrize("launcher", ["spawn", "fork", "torchrun", "subprocess"])
def test_every_rank_is_patched(tmp_path: Path, real_torch: dict[str, str], launcher: str) -> None:
    bug = layout_bug_here()
    for rank in launch(tmp_path, launcher):
        # Decided in the rank itself: patched where the bug is, standing aside where it is not.
        assert rank["status"]["applied"] is bug, rank
        assert not rank["status"]["reason"].startswith("armed: waiting"), rank
        assert rank["sharded"], rank
        assert len(rank["losses"]) == 1 and rank["max_loss_difference"] < 1e-4, rank
    # The operator's switch in the launcher's environment reaches every rank: the bug is back.
    for rank in launch(tmp_path, launcher, FSDP_AUTOPATCH="0"):
        assert not rank["status"]["applied"] and rank["status"]["mode"] == "off", rank
        if bug:
            assert not rank["sharded"] and LAYOUT_ERROR in rank["error"], rank
        else:
            assert rank["sharded"], rank
