"""Every process of a training job runs patched, however it was started.

A job's ranks are started by torchrun, by multiprocessing (spawn or fork), or by a plain
subprocess. Each rank here (tests/programs/rank_step.py) joins a two-rank gloo group, shards each
affected transformers head and trains it next to an unsharded copy. With ``FSDP_AUTOPATCH=0``
in the launcher's environment, which every child inherits, no rank is patched and the layout
error comes back.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import (
    AFFECTED,
    LAYOUT_ERROR,
    PROGRAMS,
    assert_trains_like_unsharded,
    ci_tier,
    environment,
    json_lines,
    layout_bug_here,
    own_lines,
    pip_in,
)
from harness import RANKS, torchrun

from fsdp_autopatch._verify import free_port

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 600
RANK_STEP, LAUNCH = PROGRAMS / "rank_step.py", PROGRAMS / "launch.py"


Ranks = dict[int, dict[str, dict[str, Any]]]


def launch(where: Path, launcher: str, **variables: Optional[str]) -> tuple[Ranks, str]:
    """Start a two-rank job with ``launcher`` (tests/programs/rank_step.py's ranks, started by torchrun
    or by tests/programs/launch.py); per rank, its JSON line for each head, and the job's stderr."""
    if launcher == "torchrun":
        result = torchrun(RANK_STEP, env=environment(LAUNCHER=launcher, **variables), cwd=where,
                          timeout=JOB_TIMEOUT)
    else:
        command = [sys.executable, str(LAUNCH), launcher, str(RANKS), str(free_port())]
        result = subprocess.run(command, capture_output=True, text=True, env=environment(**variables),
                                cwd=where, timeout=JOB_TIMEOUT, check=False)
    output = f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, output
    lines = json_lines(result.stdout)
    ranks: Ranks = {}
    for line in lines:
        if line["launcher"] == launcher:
            ranks.setdefault(line["rank"], {})[line["model"]] = line
    assert sorted(ranks) == list(range(RANKS)), output
    assert all(sorted(models) == sorted(AFFECTED) for models in ranks.values()), output
    pids = {rank: {line["pid"] for line in models.values()} for rank, models in ranks.items()}
    parents = [line for line in lines if line["launcher"] == "parent"]
    assert all(len(found) == 1 for found in pids.values()), "each rank reports from one process"
    assert len({pid for found in pids.values() for pid in found} | {line["pid"] for line in parents}) == (
        RANKS + len(parents)), "each report comes from its own process"
    for parent in parents:
        assert parent["codes"] == [0] * RANKS, output
        # The launcher never imported FSDP2: whatever patched the ranks happened in the ranks.
        assert not parent["status"]["applied"], parent
    return ranks, result.stderr


LAUNCHERS = ["spawn", "fork", "torchrun", "subprocess"]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_rank_is_patched(tmp_path: Path, real_torch: dict[str, str], launcher: str) -> None:
    """Each rank shards and trains the three affected heads like the unsharded model, with
    ours where CPython refuses torch's class and torch's own where it does not."""
    bug = layout_bug_here()
    ranks, stderr = launch(tmp_path, launcher)
    assert own_lines(stderr) == [], "the fix runs: nothing to say"
    for models in ranks.values():
        for result in models.values():
            # Decided in the rank itself: patched where the bug is, standing aside where it is not.
            assert result["status"]["applied"] is bug, result
            assert not result["status"]["reason"].startswith("armed: waiting"), result
            assert_trains_like_unsharded(result)
            assert result["max_loss_difference"] < 1e-4, result
            assert result["upstream_bases"] is not bug, result


# One launcher's control in the README's tests; every launcher's in CI's tier.
@pytest.mark.parametrize("launcher", [*ci_tier(*LAUNCHERS[:1]), LAUNCHERS[1], *ci_tier(*LAUNCHERS[2:])])
def test_the_switch_in_the_launchers_environment_reaches_every_rank(
    tmp_path: Path, real_torch: dict[str, str], launcher: str
) -> None:
    """The operator's switch in the launcher's environment reaches every rank: the bug is back."""
    bug = layout_bug_here()
    for models in launch(tmp_path, launcher, FSDP_AUTOPATCH="0")[0].values():
        for result in models.values():
            assert not result["status"]["applied"] and result["status"]["mode"] == "off", result
            if bug:
                assert not result["sharded"] and LAYOUT_ERROR in result["error"], result
            else:
                assert result["sharded"] and result["upstream_bases"] is True, result


# The launcher the issue met (torch.multiprocessing's spawn sets no LOCAL_RANK) in the README's
# tests; every other in CI's tier.
@pytest.mark.parametrize("launcher", [LAUNCHERS[0], *ci_tier(*LAUNCHERS[1:])])
def test_one_line_per_node_where_the_fix_cannot_run(
    tmp_path: Path, real_torch: dict[str, str], launcher: str
) -> None:
    """wrapt missing in every rank, and each rank's script calling
    ``logging.basicConfig(level=logging.INFO)`` as training scripts do: the job says why the fix
    cannot run once in all, where the bug is, whether its launcher sets ``LOCAL_RANK`` (torchrun)
    or not (spawn, fork, a plain subprocess); the log's record of it stays below INFO, and no
    file of the package is left in the temporary directory."""
    missing = tmp_path / "without wrapt"
    missing.mkdir()
    (missing / "wrapt.py").write_text('raise ModuleNotFoundError("No module named wrapt", name="wrapt")\n')
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    ranks, stderr = launch(tmp_path, launcher, PYTHONPATH=str(missing), TMPDIR=str(scratch),
                           TRAINING_SCRIPT_LOGGING="basicConfig")
    line = ("fsdp-autopatch: cannot fix the layout bug for ABC modules here: wrapt is not installed "
            f"({pip_in(sys.executable, 'install wrapt')})")
    assert own_lines(stderr) == [line][:layout_bug_here()], stderr[-3000:]
    # basicConfig's format is LEVEL:logger:message: none of the package's records reach it.
    assert ":fsdp_autopatch:" not in stderr, stderr[-3000:]
    assert list(scratch.glob("*fsdp-autopatch*")) == []
    for models in ranks.values():
        for result in models.values():
            assert not result["status"]["applied"] and result["status"]["reason"].startswith("wrapt is not")
