"""The hooks: when the patch is installed, what it says, and that it happens once.

Fresh interpreters of the installed package, with real torch and transformers. Import orders and
threads are covered with the full proof in test_fully_shard.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import LAYOUT_ERROR, environment, run_python, shard_abc_head

pytestmark = pytest.mark.slow

def test_apply_patches_modules_imported_before_it(installed: Path) -> None:
    """``python -S`` reads no .pth (as embedded or PYTHONPATH installs): ``apply()`` then patches
    the torch and transformers that are already imported."""
    without = shard_abc_head("-S", PYTHONPATH=str(installed))
    assert "not armed" in without["before"]["reason"]
    assert LAYOUT_ERROR in without["error"]

    report = shard_abc_head("-S", calls="fsdp_autopatch.apply()", PYTHONPATH=str(installed))
    assert report["after"]["applied"] is True and report["error"] is None


def test_patch_is_installed_once(installed: Path) -> None:
    report = shard_abc_head(calls="fsdp_autopatch.apply(); fsdp_autopatch.apply(force=True)")
    assert report["before"]["applied"] is True
    assert report["cache_type"] == "LayoutFixingCache" and report["cache_kept"] is True
    assert report["error"] is None
    assert LAYOUT_ERROR in shard_abc_head(FSDP_AUTOPATCH="0")["error"]


def test_force_mode_patches_whatever_the_versions(installed: Path) -> None:
    report = shard_abc_head(FSDP_AUTOPATCH="force")
    assert report["before"]["applied"] is True and report["before"]["mode"] == "force"
    assert "force" in report["before"]["reason"] and report["error"] is None


IMPORT_BOTH = (
    "import torch.distributed.fsdp, transformers, fsdp_autopatch; print(fsdp_autopatch.status().applied)"
)


def ours(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "fsdp-autopatch" in line or "FSDP_AUTOPATCH" in line]


def test_silent_by_default_and_one_info_line_when_asked(installed: Path) -> None:
    quiet = run_python(IMPORT_BOTH)
    assert quiet.stdout == "True\n" and ours(quiet.stderr) == []
    told = run_python(IMPORT_BOTH, env=environment(FSDP_AUTOPATCH_LOG="info"))
    (line,) = ours(told.stderr)
    assert line.startswith("fsdp-autopatch INFO: patched fully_shard") and "transformers 4.55.2" in line


@pytest.mark.parametrize("value", ["yes please", "ünïcødé", "$(rm -rf ~) ; `id` | &", "x" * 5000])
def test_bad_switch_value_warns_once_and_runs_in_auto_mode(installed: Path, value: str) -> None:
    result = run_python(IMPORT_BOTH, env=environment(FSDP_AUTOPATCH=value))
    assert result.returncode == 0 and result.stdout == "True\n"
    (line,) = ours(result.stderr)
    assert line.startswith("fsdp-autopatch: ignoring FSDP_AUTOPATCH=") and len(line) < 300
    assert "0|off|false|no|disable" in line
