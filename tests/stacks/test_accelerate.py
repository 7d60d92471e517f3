"""accelerate's own FSDP2 preparation of a sequence-classification reward model, on 2 gloo CPU
ranks, with the package on and with FSDP_AUTOPATCH=0.

accelerate never picks FSDP on a CPU; the rank script sets ``distributed_type`` to FSDP so that
``prepare()`` takes the path it takes on GPUs (see rank_accelerate.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import environment, json_lines, own_lines, pip_in

from stacks.conftest import Claim
from stacks.launch import (
    OFFLINE,
    TIMEOUT,
    TOLERANCE,
    Run,
    assert_losses_match_reference,
    assert_reward_model_sharded_by_accelerate,
    bug_expected,
    describe_without,
    with_and_without,
)

pytestmark = [pytest.mark.stacks, pytest.mark.slow]


@pytest.mark.stacks_ci
def test_accelerate_fsdp2_prepares_trains_saves_and_reloads(
    tmp_path: Path, installed: Path, claim: Claim
) -> None:
    def check(run: Run) -> None:
        result = run.result
        assert_reward_model_sharded_by_accelerate(result)
        assert len(result["losses"]) == 3
        assert_losses_match_reference(result)
        assert result["state_keys_equal"] is True
        assert result["state_vs_reference"] < TOLERANCE
        assert result["reloaded_vs_reference"] < TOLERANCE
        assert result["sharded_vs_reference"] < TOLERANCE

    _, unpatched = with_and_without("rank_accelerate.py", "saved", cwd=tmp_path, check=check)
    claim("trained like an unsharded copy; full state dict, saved model and the model reloaded "
          "from it equal the copy's", describe_without(unpatched))


# accelerate's own FSDP2, as `accelerate config` writes it for two processes on one machine.
FSDP2_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_reshard_after_forward: true
machine_rank: 0
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


@pytest.mark.stacks_ci
def test_accelerate_launch_says_the_line_once_and_its_fsdp2_does_not_shard_on_a_cpu(
    tmp_path: Path, installed: Path
) -> None:
    """``accelerate launch`` with ``fsdp_version: 2`` and wrapt missing. Its launcher imports
    FSDP2 and transformers itself, then starts two ranks that do too: one line in all (0.2.0
    printed two). And what the README says beside "Works with": on a CPU accelerate does not
    take its FSDP path at all, so nothing is sharded, and it says nothing of it."""
    config = tmp_path / "fsdp2.yaml"
    config.write_text(FSDP2_CONFIG)
    missing = tmp_path / "without-wrapt"
    missing.mkdir()
    (missing / "wrapt.py").write_text('raise ModuleNotFoundError("No module named wrapt", name="wrapt")\n')
    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert launcher is not None, "accelerate's launcher is not installed beside this Python"
    script = Path(__file__).with_name("rank_accelerate_launch.py")
    path = os.pathsep.join((str(missing), str(script.parent)))  # the rank imports rank_common
    result = subprocess.run([launcher, "launch", "--config_file", str(config), str(script)],
                            capture_output=True, text=True, cwd=tmp_path, timeout=TIMEOUT, check=False,
                            env=environment(**OFFLINE, PYTHONPATH=path))
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = json_lines(result.stdout)
    assert sorted(rank["local_rank"] for rank in ranks) == ["0", "1"], result.stdout
    for rank in ranks:
        # 1.10 falls back to DDP (MULTI_CPU), 1.16 to no distribution at all (NO): two unsharded
        # copies, and no word of it on stderr.
        assert rank["distributed_type"] in ("DistributedType.MULTI_CPU", "DistributedType.NO"), rank
        assert rank["sharded"] is False, rank
    assert "fsdp" not in result.stderr.lower().replace("fsdp-autopatch", ""), result.stderr[-4000:]
    line = ("fsdp-autopatch: cannot fix the layout bug for ABC modules here: wrapt is not installed "
            f"({pip_in(sys.executable, 'install wrapt')})")
    assert own_lines(result.stderr) == [line][:bug_expected()], result.stderr[-4000:]
