"""PEFT LoRA on a sequence-classification reward model on 2 gloo CPU ranks, with the package on and
with FSDP_AUTOPATCH=0.

Sharded as PEFT users shard it (decoder layers, then the PeftModel), the class with the ABC base
is not a unit of its own, so this layout trains with or without the patch, and the patch must
leave it exactly as torch does. Making the inner transformers model a unit is where the layout
error shows without the patch; with it, sharding succeeds and the forward then hits PEFT's own
trap (``BaseTuner.forward`` calls ``self.model.forward``, bypassing FSDP's hooks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stacks.conftest import Claim
from stacks.launch import TOLERANCE, Run, assert_losses_match_reference, bug_expected, on_ranks

pytestmark = [pytest.mark.stacks, pytest.mark.slow]
HOOKS_BYPASSED = "mixed torch.Tensor and DTensor"


def assert_peft_layout_trains(result: dict[str, object]) -> None:
    assert result["sharded"] is True
    assert result["wrapper"] == {"name": "FSDPPeftModelForSequenceClassification", "is_fsdp_module": True}
    assert result["inner_class"] == "Qwen2ForSequenceClassification"
    assert result["layer_wrapper"] == "FSDPQwen2DecoderLayer"
    assert result["adapter_keys_equal"] is True and result["trainable"] > 0
    assert_losses_match_reference(result)
    assert result["adapters_vs_reference"] < TOLERANCE
    assert result["scores_vs_reference"] < TOLERANCE


def test_lora_reward_model_sharded_as_peft_users_shard_it(
    tmp_path: Path, installed: Path, claim: Claim
) -> None:
    patched = on_ranks("rank_peft.py", patched=True, cwd=tmp_path / "patched")
    assert patched.error is None, patched.error
    assert patched.status["applied"] is bug_expected()
    assert_peft_layout_trains(patched.result)
    # The class swap works; the forward then fails the way it does on a transformers without the bug.
    inner = patched.result["inner_unit"]
    assert inner["sharded"] is True and HOOKS_BYPASSED in inner["forward"], inner

    unpatched: Run = on_ranks("rank_peft.py", patched=False, cwd=tmp_path / "unpatched")
    assert unpatched.error is None, unpatched.error
    assert unpatched.status["applied"] is False
    # Same numbers as patched: the patch leaves a layout without ABC units exactly as torch does.
    assert_peft_layout_trains(unpatched.result)
    assert unpatched.result["losses"] == patched.result["losses"]
    inner = unpatched.result["inner_unit"]
    if bug_expected():
        assert inner["sharded"] is False and "object layout differs" in inner["error"], inner
    else:
        assert inner["sharded"] is True and HOOKS_BYPASSED in inner["forward"], inner
    claim(
        "PeftModel and its decoder layers sharded: LoRA trains like an unsharded PEFT copy; the "
        "inner model as a unit of its own shards, then its forward hits PEFT's hook bypass (trap below)",
        "PeftModel and its decoder layers: works the same (no ABC class is a unit there); the inner "
        "model as its own unit " + ("fails: `object layout differs`" if bug_expected() else "shards"),
    )
