"""TRL's RewardTrainer through accelerate's FSDP2 path on 2 gloo CPU ranks, with the package on
and with FSDP_AUTOPATCH=0: train, save_model, reload with from_pretrained, same rewards."""

from __future__ import annotations

from pathlib import Path

import pytest

from stacks.conftest import Claim
from stacks.launch import (
    TOLERANCE,
    Run,
    assert_reward_model_sharded_by_accelerate,
    describe_without,
    with_and_without,
)

pytestmark = [pytest.mark.stacks, pytest.mark.slow]


def test_reward_trainer_trains_saves_and_reloads(tmp_path: Path, installed: Path, claim: Claim) -> None:
    def check(run: Run) -> None:
        result = run.result
        assert_reward_model_sharded_by_accelerate(result)
        assert len(result["losses"]) == 4
        # Trained: rewards moved, and chosen answers now score above rejected ones.
        assert result["moved"] > 0.01
        assert result["margin_after"] > result["margin_before"] + 0.1, result
        # save_model wrote full weights (FULL_STATE_DICT), and they are the trained model's.
        assert "model.safetensors" in result["saved_files"]
        assert result["reloaded_vs_trained"] < TOLERANCE

    _, unpatched = with_and_without("rank_trl.py", "output", cwd=tmp_path, check=check)
    claim("trained (chosen rewards rose above rejected); `save_model` + `from_pretrained` give the "
          "trained model's rewards", describe_without(unpatched))
