"""Megatron-FSDP's experimental ``fully_shard`` is a site like torch's, proven on the CPU.

tests/programs/megatron_wrap.py runs with real megatron-fsdp, torch and transformers on a 1-rank gloo
group, with the package and with ``FSDP_AUTOPATCH=0``: the affected head's decoder layers and root,
a user's ``abc.ABC``-first module, and plain modules. Its forward needs CUDA, so the training
proof is tests/programs/megatron_train.py, run where a GPU is lent (test_megatron_trains_on_cuda).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from conftest import PROGRAMS, environment, json_lines, layout_bug_here, run_program

pytestmark = pytest.mark.slow

SITE = "megatron_fsdp.experimental.fully_shard.fully_shard"


def run(program: str, *args: str, prepared: bool = False, **env: str) -> dict[str, Any]:
    pytest.importorskip("megatron_fsdp", reason="megatron-fsdp is not installed; the tests session has it")
    result = run_program(PROGRAMS / program, *args, env=environment(**env), prepared=prepared)
    (report,) = json_lines(result.stdout)
    return report


def test_megatron_fsdp_wraps_affected_heads_and_leaves_plain_modules_its_own_class(
    real_torch: dict[str, str]
) -> None:
    # Megatron-FSDP imports FSDP2 itself: with the package off, a prepared interpreter (FSDP2 and
    # transformers imported) is what a fresh one is once megatron_wrap.py has imported them.
    # Patched, a fresh one: Megatron-FSDP first, then transformers arms the patch.
    alone = run("megatron_wrap.py", FSDP_AUTOPATCH="0", prepared=True)
    patched = run("megatron_wrap.py")
    bug = layout_bug_here()
    # Without the package: the layers wrap, the root and the user's ABC module hit the layout error.
    unaided = "layout" if bug else "wrapped"
    assert (alone["layers"], alone["head"], alone["user_head"]) == (["wrapped"], unaided, unaided)
    assert alone["status"] == {"applied": False, "classes": [], "sites": []}
    # With it: everything wraps, through the site, self-checked.
    assert (patched["layers"], patched["head"], patched["user_head"]) == (["wrapped"], "wrapped", "wrapped")
    assert SITE in patched["status"]["sites"] and patched["status"]["applied"] is bug
    outcomes = dict(map(tuple, patched["status"]["classes"]))
    assert outcomes["Qwen2ForSequenceClassification"] == ("compatible" if bug else "torch")
    # Where CPython refuses Megatron-FSDP's class, the first base is its mirror on abc.ABC.
    assert patched["head_class"] == {"first_base": "ABCFsdpModule" if bug else "FsdpModule",
                                     "original_at_2": True, "is_fsdp_module": True}
    # Plain modules: exactly Megatron-FSDP's own class, its bases and its empty namespace, one
    # class per call, with or without the package.
    for report in (alone, patched):
        assert report["plain"] == ["wrapped", "wrapped"] and report["one_class_per_call"] is True
        for described in report["plain_classes"]:
            assert described["torch_shape"] is True and described["namespace"] == []
            assert described["module"] == "megatron_fsdp.experimental.fully_shard"
    assert patched["plain_classes"] == alone["plain_classes"]


def test_megatron_trains_on_cuda() -> None:
    """Megatron-FSDP's forward needs CUDA: where a GPU is, a wrapped head trains like its
    unwrapped copy with the package, and fails with the layout error without it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("Megatron-FSDP's forward needs CUDA; run on a machine with a GPU: "
                    "python tests/programs/megatron_train.py (exit 0 patched, 1 with FSDP_AUTOPATCH=0)")
    patched = run("megatron_train.py")
    assert patched["trained"] is True and patched["max_loss_difference"] < 1e-4
    alone = subprocess.run([sys.executable, str(PROGRAMS / "megatron_train.py")], capture_output=True,
                           text=True, env=environment(FSDP_AUTOPATCH="0"), timeout=600, check=False)
    assert alone.returncode == 1 and "object layout differs" in alone.stdout
