"""torch's own stack around a sharded reward model: distributed checkpoints, meta-device
construction, torch.compile. Each case runs on 2 gloo CPU ranks with the package on and with
FSDP_AUTOPATCH=0."""

from __future__ import annotations

from pathlib import Path

import pytest

from stacks.conftest import Claim
from stacks.launch import TOLERANCE, Run, assert_losses_match_reference, describe_without, with_and_without

pytestmark = [pytest.mark.stacks, pytest.mark.slow]


def assert_trained_like_reference(result: dict[str, object]) -> None:
    assert result["sharded"] is True, result
    assert result["wrapper"] == {"name": "FSDPQwen2ForSequenceClassification", "is_fsdp_module": True}
    assert_losses_match_reference(result)


@pytest.mark.stacks_ci
def test_dcp_round_trip_restores_model_and_optimizer(
    tmp_path: Path, installed: Path, claim: Claim
) -> None:
    def check(run: Run) -> None:
        result = run.result
        assert_trained_like_reference(result)
        assert result["differed_before_load"] > 0.01  # the restored model started elsewhere
        # Loading copies the saved tensors: exactly equal, and so is the next AdamW step.
        assert result["restored_vs_saved"] == 0.0
        assert result["next_step_restored_vs_saved"] == 0.0
        assert result["after_step_restored_vs_saved"] == 0.0
        assert result["saved_vs_reference"] < TOLERANCE
        assert result["after_step_vs_reference"] < TOLERANCE

    _, unpatched = with_and_without("rank_dcp.py", "checkpoint", cwd=tmp_path, check=check)
    claim("saved and loaded model + optimizer state; restored model's scores and next step equal "
          "the saved model's and an unsharded copy's", describe_without(unpatched))


def test_meta_device_init_then_train(tmp_path: Path, installed: Path, claim: Claim) -> None:
    def check(run: Run) -> None:
        result = run.result
        assert result["built_on_meta"] is True
        assert result["rotary_recomputed"] == 1
        assert_trained_like_reference(result)
        assert result["initial_vs_reference"] < TOLERANCE
        assert result["after_vs_reference"] < TOLERANCE

    _, unpatched = with_and_without("rank_meta_init.py", cwd=tmp_path, check=check)
    claim("initialised and trained like an unsharded copy of the same weights",
          describe_without(unpatched))


BACKENDS = ("eager", "aot_eager")


@pytest.mark.stacks_ci
def test_compile_matches_eager(tmp_path: Path, installed: Path, claim: Claim) -> None:
    def check(run: Run) -> None:
        assert [result["backend"] for result in run.results] == list(BACKENDS)
        for result in run.results:
            assert result["sharded"] is True and result["compiled_type"] == "OptimizedModule"
            assert result["graphs"] > 0, result  # dynamo did compile, not fall back to eager
            assert result["wrapper"]["name"] == "FSDPQwen2ForSequenceClassification"
            assert result["compiled_vs_eager"] < TOLERANCE, result
            assert result["eager_vs_reference"] < TOLERANCE, result
            assert result["scores_compiled_vs_eager"] < TOLERANCE, result

    _, unpatched = with_and_without("rank_compile.py", *BACKENDS, cwd=tmp_path, check=check)
    claim(f"{' and '.join(BACKENDS)}: compiled losses and scores equal eager's and an unsharded "
          "copy's", describe_without(unpatched))
