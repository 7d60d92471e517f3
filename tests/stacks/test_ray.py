"""Ray actors, as verl, OpenRLHF and NeMo-RL run their FSDP workers: two actors of a local Ray
cluster form a gloo group and shard a sequence-classification head with FSDP2 (tests/stacks/
ray_job.py). The actors' interpreters are started by Ray's raylet, read the environment's
``.pth`` and set ``RANK`` and ``LOCAL_RANK`` only in ``__init__``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import LAYOUT_ERROR, environment, json_lines, pip_in

from stacks.conftest import Claim
from stacks.launch import OFFLINE, TIMEOUT, bug_expected

pytestmark = [pytest.mark.stacks, pytest.mark.slow]
JOB = Path(__file__).with_name("ray_job.py")


def interpreter(tmp_path: Path) -> str:
    """This environment's interpreter, by a path Ray can start workers from. Ray 2.60's raylet
    starts a ``runtime_env``'s workers through a shell line that does not quote the interpreter's
    path, so an environment whose path holds a space fails there, with or without the package
    ("bash: line 1: /tmp/a: No such file or directory"): such an environment is run through a
    link to it from a path without one."""
    if not any(character.isspace() for character in sys.prefix):
        return sys.executable
    link = tmp_path / "environment"
    if not link.is_symlink():
        link.symlink_to(sys.prefix, target_is_directory=True)
    return str(link / Path(sys.executable).relative_to(sys.prefix))


def ray_job(tmp_path: Path, *args: str) -> tuple[list[dict], str]:
    """The actors' results, and what the driver printed on stderr (Ray forwards the actors')."""
    result = subprocess.run([interpreter(tmp_path), str(JOB), *args], capture_output=True, text=True,
                            env=environment(**OFFLINE), cwd=tmp_path, timeout=TIMEOUT, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    (report,) = json_lines(result.stdout)
    return report["ranks"], result.stderr


@pytest.mark.stacks_ci
def test_ray_actors_shard_and_train_an_affected_head(tmp_path: Path, installed: Path, claim: Claim) -> None:
    ranks, stderr = ray_job(tmp_path)
    bug = bug_expected()
    for rank in ranks:
        assert rank["sharded"] and rank["max_loss_difference"] == 0.0, rank
        assert rank["applied"] is bug and rank["armed_by"] == "fsdp_autopatch.pth at interpreter start"
        assert rank["upstream_bases"] is not bug
    assert "fsdp-autopatch" not in stderr
    # runtime_env's env_vars reach the actors before their interpreters start: the switch works.
    off, _ = ray_job(tmp_path, "--off")
    for rank in off:
        assert rank["mode"] == "off" and (not rank["sharded"] and LAYOUT_ERROR in rank["error"]) is bug
    # wrapt missing on the actors: the driver shows the one line once, not once per actor.
    missing = tmp_path / "without-wrapt"
    missing.mkdir()
    (missing / "wrapt.py").write_text('raise ModuleNotFoundError("No module named wrapt", name="wrapt")\n')
    unfixed, said = ray_job(tmp_path, "--pythonpath", str(missing))
    assert all(not rank["applied"] for rank in unfixed)
    # The remedy names the actors' interpreter: the one the driver runs, which Ray starts them with.
    line = ("fsdp-autopatch: cannot fix the layout bug for ABC modules here: wrapt is not installed "
            f"({pip_in(interpreter(tmp_path), 'install wrapt')})")
    assert sum(line in printed for printed in said.splitlines()) == int(bug), said[-3000:]
    claim("two actors (gloo) shard and train a 4.55.2 reward model like an unsharded copy; without "
          "wrapt, one line at the driver",
          "runtime_env FSDP_AUTOPATCH=0: the layout error" if bug else "wraps (no bug here)")
