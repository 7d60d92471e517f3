"""accelerate's own FSDP2 preparation of a sequence-classification reward model, on 2 gloo CPU
ranks, with the package on and with FSDP_AUTOPATCH=0.

accelerate never picks FSDP on a CPU; the rank script sets ``distributed_type`` to FSDP so that
``prepare()`` takes the path it takes on GPUs (see rank_accelerate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stacks.conftest import Claim
from stacks.launch import (
    TOLERANCE,
    Run,
    assert_losses_match_reference,
    assert_reward_model_sharded_by_accelerate,
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
