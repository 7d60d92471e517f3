"""The pytest side of the stacks tests: launch a rank-side script on 2 gloo CPU ranks, read it.

Each script runs under ``python -m torch.distributed.run`` of the environment under test, so every
rank starts as a user's process does and the installed ``fsdp_autopatch.pth`` is what patches it
(or, with ``FSDP_AUTOPATCH=0``, does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from conftest import LAYOUT_ERROR, environment, json_lines
from harness import torchrun

HERE = Path(__file__).resolve().parent
TIMEOUT = 900
# Sharded and unsharded copies see the same batch on every rank, so FSDP2's averaged gradients
# are the unsharded ones: the losses agree to float32 rounding (here they are bitwise equal).
TOLERANCE = 1e-5
# Nothing may come from the hub or report anywhere: tiny models are built from configs.
OFFLINE = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
    # Two ranks share two cores: one thread each, or they fight over the cores.
    "OMP_NUM_THREADS": "1",
}


@dataclass
class Run:
    """What rank 0 printed: the case's result lines, or the error that ended the case."""

    results: list[dict[str, Any]] = field(default_factory=list)
    error: Optional[str] = None
    status: dict[str, Any] = field(default_factory=dict)
    stderr: str = ""

    @property
    def result(self) -> dict[str, Any]:
        """The one result line of a case that prints one."""
        assert len(self.results) == 1, self.results
        return self.results[0]

    @property
    def layout_error(self) -> bool:
        return self.error is not None and LAYOUT_ERROR in self.error


def bug_expected() -> bool:
    """Whether this CPython and torch refuse the class swap without the patch."""
    try:
        from conftest import layout_bug_here  # type: ignore[attr-defined]
    except ImportError:
        return True  # every CPython 3.9 - 3.14 with every torch up to 2.15.0
    return bool(layout_bug_here())


def on_ranks(script: str, *args: str, patched: bool, cwd: Path, **variables: Optional[str]) -> Run:
    """Run ``tests/stacks/<script>`` on 2 ranks under torchrun, the package on (default mode) or off."""
    env = environment(FSDP_AUTOPATCH=None if patched else "0", **OFFLINE, **variables)
    cwd.mkdir(parents=True, exist_ok=True)
    completed = torchrun(HERE / script, *args, env=env, cwd=cwd, timeout=TIMEOUT)
    run = Run(stderr=completed.stderr)
    for line in json_lines(completed.stdout):
        if "status" in line:
            run.status = line["status"]
        elif set(line) == {"error"}:  # the case ended with an exception (rank_common.run)
            run.error = line["error"]
        else:
            run.results.append(line)
    assert run.status, f"{script} printed no status line:\n{completed.stdout[-3000:]}"
    return run


def with_and_without(
    script: str, *args: str, cwd: Path, check: Callable[[Run], None], **variables: Optional[str]
) -> tuple[Run, Run]:
    """The case patched, then with ``FSDP_AUTOPATCH=0``; ``check`` must hold for the patched run,
    and for the unpatched one too where the bug is absent; where it is present, the unpatched run
    must end with the layout error."""
    patched = on_ranks(script, *args, patched=True, cwd=cwd / "patched", **variables)
    assert patched.error is None, f"patched run failed: {patched.error}\n{patched.stderr[-4000:]}"
    assert patched.status.get("applied") is bug_expected(), patched.status
    check(patched)
    unpatched = on_ranks(script, *args, patched=False, cwd=cwd / "unpatched", **variables)
    assert unpatched.status.get("applied") is False, unpatched.status
    if bug_expected():
        assert unpatched.layout_error, (
            f"expected the layout error, got {unpatched.error or unpatched.results}")
    else:
        assert unpatched.error is None, unpatched.error
        check(unpatched)
    return patched, unpatched


def assert_losses_match_reference(result: dict[str, Any]) -> None:
    """The sharded model's training losses are those of its unsharded copy."""
    assert result["trained_vs_reference"] < TOLERANCE, (result["losses"], result["reference_losses"])


def describe_without(run: Run) -> str:
    """The README's words for the run with ``FSDP_AUTOPATCH=0``."""
    if run.layout_error:
        return "fails: `object layout differs`"
    return "fails: " + (run.error or "?") if run.error else "works (no bug here)"


def assert_reward_model_sharded_by_accelerate(result: dict[str, Any]) -> None:
    """accelerate's FSDP2 path ran (its state says FSDP, not the DDP it falls back to on a CPU)
    and made the reward model and its decoder layers FSDP units."""
    expected = {
        "distributed_type": "DistributedType.FSDP",
        "sharded": True,
        "wrapper": {"name": "FSDPQwen2ForSequenceClassification", "is_fsdp_module": True},
        "layer_wrapper": "FSDPQwen2DecoderLayer",
    }
    found = {key: result.get(key) for key in expected}
    assert found == expected, f"accelerate did not shard the reward model with FSDP2: {found}"
