"""The hooks: when the patch is installed, what it says, and that it happens once; the probe
that decides whether it is needed, run on real torch.

Fresh interpreters of the installed package, with real torch and transformers. Import orders and
threads are covered with the full proof in test_fully_shard.py. Where this torch and Python have
no layout bug (``layout_bug_here()`` is False, as on CPython 3.15), the same tests check that the
patch stands aside.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import (
    LAYOUT_ERROR,
    PROGRAMS,
    environment,
    json_lines,
    layout_bug_here,
    own_lines,
    run_program,
    shard_abc_head,
)

import fsdp_autopatch
from fsdp_autopatch import DDP_MODULE

pytestmark = pytest.mark.slow


def assert_unpatched_torch(report: dict[str, object]) -> None:
    """Without the patch, an ABC head fails exactly where this torch and Python have the bug."""
    if layout_bug_here():
        assert LAYOUT_ERROR in str(report["error"])
    else:
        assert report["error"] is None


def test_apply_patches_modules_imported_before_it(installed: Path) -> None:
    """``python -S`` reads no .pth (as embedded or PYTHONPATH installs), and with torch's plugin
    entry points off (as torch 2.4 has none) nothing arms the package: ``apply()`` then patches
    the torch and transformers that are already imported. (With the plugins on, torch's own
    entry point arms it: tests/test_plugin.py.)"""
    # site-packages, and where the package is imported from (the checkout, for an editable install).
    path = os.pathsep.join((str(installed), str(Path(fsdp_autopatch.__file__).parent.parent)))
    nothing_arms = {"PYTHONPATH": path, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    without = shard_abc_head("-S", **nothing_arms)
    assert "not armed" in without["before"]["reason"]
    assert_unpatched_torch(without)

    report = shard_abc_head("-S", calls="apply", **nothing_arms)
    assert report["after"]["applied"] is layout_bug_here() and report["error"] is None
    assert report["after"]["decided_by"] == "probe"


def test_patch_is_installed_once(installed: Path) -> None:
    # Where there is no bug, auto mode stands aside and force then installs it: once either way.
    report = shard_abc_head(calls="apply-then-force", prepared=True)
    assert report["before"]["applied"] is True
    # One stand-in for type, found by the code of the builder torch 2.11+ share only (the
    # module's own type stays the builtin), serving FSDPModule once; torch's cache is its own dict.
    assert report["stand_in"] == ["TypeStandIn", 1] and report["module_binds_type"] is False
    assert report["cache_type"] == "dict" and report["cache_kept"] is True
    assert report["error"] is None
    assert_unpatched_torch(shard_abc_head(FSDP_AUTOPATCH="0", prepared=True))


@pytest.mark.ci_tier
def test_force_mode_patches_whatever_the_versions(installed: Path) -> None:
    report = shard_abc_head(FSDP_AUTOPATCH="force")
    assert report["before"]["applied"] is True and report["before"]["mode"] == "force"
    assert report["before"]["decided_by"] is None
    assert "force" in report["before"]["reason"] and report["error"] is None


IMPORT_BOTH = PROGRAMS / "import_both.py"


def test_silent_by_default(real_torch: dict[str, str]) -> None:
    """Importing FSDP2 and transformers, patched where the bug is, prints nothing."""
    quiet = run_program(IMPORT_BOTH)
    assert quiet.stdout == f"{layout_bug_here()}\n" and own_lines(quiet.stderr) == []


@pytest.mark.ci_tier
def test_at_info_nothing_and_the_sites_are_debug(real_torch: dict[str, str]) -> None:
    """Importing FSDP2 and transformers changes nothing in a run: nothing at INFO (a compatible
    class built is INFO, tests/test_fully_shard.py); the decision and the sites patched at DEBUG."""
    assert own_lines(run_program(IMPORT_BOTH, env=environment(FSDP_AUTOPATCH_LOG="info")).stderr) == []
    # An application that logs at INFO reads as many lines of the package's as without it: none.
    for mode in ("auto", "0"):
        logged = run_program(IMPORT_BOTH, "--log-info", env=environment(FSDP_AUTOPATCH=mode)).stderr
        assert [line for line in logged.splitlines() if line.startswith("fsdp_autopatch ")] == [], mode
    told = own_lines(run_program(IMPORT_BOTH, env=environment(FSDP_AUTOPATCH_LOG="debug")).stderr)
    decision = [line for line in told if "(decided by the probe)" in line]
    assert len(decision) == 1 and f"transformers {real_torch['transformers']}" in decision[0]
    assert decision[0].startswith(f"fsdp-autopatch DEBUG: {'' if layout_bug_here() else 'not '}patching")
    sites = [line.split(" at ")[0] for line in told if line.startswith("fsdp-autopatch DEBUG: patched ")]
    # FSDP2 imports composable DDP too.
    assert sites == (["fsdp-autopatch DEBUG: patched FSDP2 fully_shard",
                      "fsdp-autopatch DEBUG: patched composable DDP replicate"] if layout_bug_here() else [])


# On the stand-in torch in the README's tests (tests/test_faults.py's test_bad_mode_value).
@pytest.mark.ci_tier
@pytest.mark.parametrize("value", ["yes please", "ünïcødé", "$(rm -rf ~) ; `id` | &", "x" * 5000])
def test_bad_switch_value_warns_once_and_runs_in_auto_mode(installed: Path, value: str) -> None:
    result = run_program(IMPORT_BOTH, env=environment(FSDP_AUTOPATCH=value))
    assert result.returncode == 0 and result.stdout == f"{layout_bug_here()}\n"
    (line,) = own_lines(result.stderr)
    assert line.startswith("fsdp-autopatch: ignoring FSDP_AUTOPATCH=") and len(line) < 300
    assert "0|off|false|no|disable" in line


def test_probe_answers_what_fully_shard_does(real_torch: dict[str, str]) -> None:
    """The real probe on real torch says "bug" exactly where fully_shard, unpatched, fails on an
    ABC module; through torch's helper or an inline construction alike; and it leaves torch's
    cache alone."""
    result = run_program(PROGRAMS / "probe_and_shard.py", env=environment(FSDP_AUTOPATCH="0"), prepared=True)
    (report,) = json_lines(result.stdout)
    bug = report["error"] is not None and LAYOUT_ERROR in report["error"]
    assert report["error"] is None or bug, report["error"]
    assert report["helper"] is bug and report["inline"] is bug and report["reordered"] is bug
    assert report["unknown_signature"] is None
    assert report["cache_untouched"] is True
    assert layout_bug_here() is bug


FULLY_SHARD_SITE = "torch.distributed.fsdp._fully_shard._fully_shard"


# The log's records of a fix that cannot run: INFO, as docs/how-it-works.md has them (a class
# built or refused is INFO too, told apart by its text); the one line on stderr is what warns.
CANNOT_RUN_RECORD = "fsdp-autopatch INFO: "


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(CANNOT_RUN_RECORD)
            and not line.startswith((f"{CANNOT_RUN_RECORD}built ", f"{CANNOT_RUN_RECORD}cannot build "))]


@pytest.mark.ci_tier
def test_unknown_fsdp2_layout_is_said_within_the_import(real_torch: dict[str, str]) -> None:
    """FSDP2 imported, ``fully_shard`` there, none of the known sites: the status says so within
    that import, with one warning; composable DDP, imported with it, is still patched once
    transformers is there."""
    moved = run_program(PROGRAMS / "moved_name.py", "fsdp2-then-transformers",
                        env=environment(FSDP_AUTOPATCH_LOG="info"))
    first, second = json_lines(moved.stdout)
    status = first["at_fsdp2"]
    (warning,) = warnings_of(moved.stderr)
    expected = warning.removeprefix("fsdp-autopatch INFO: ")
    from fsdp_autopatch import __version__

    assert expected.startswith("FSDP2 fully_shard runs unpatched: torch ")
    assert f"'s FSDP2 layout is unknown to fsdp-autopatch {__version__}" in expected
    assert expected.endswith("; upgrade fsdp-autopatch")
    assert status["applied"] is False and status["reason"].endswith(f"; {expected}")
    assert status["transformers"] is None
    after = second["at_transformers"]
    assert after["transformers"] == real_torch["transformers"] and after["reason"].endswith(f"; {expected}")
    assert after["sites"] == ([f"{DDP_MODULE}.replicate"] if layout_bug_here() else [])
    # Once transformers shows the bug is here, the user reads it, once, by default too.
    problem = expected.removeprefix("FSDP2 fully_shard runs unpatched: ")
    problem = problem.removesuffix("; upgrade fsdp-autopatch")
    said = [f"fsdp-autopatch: cannot fix FSDP2 fully_shard's layout bug for ABC modules here: {problem} "
            "(upgrade fsdp-autopatch)"] if layout_bug_here() else []
    assert [line for line in own_lines(moved.stderr) if not line.startswith(CANNOT_RUN_RECORD)] == said
    assert own_lines(run_program(PROGRAMS / "moved_name.py", "fsdp2-then-transformers").stderr) == said

    # The same process with torch's names where they are: waiting for transformers, silent.
    known = run_program(PROGRAMS / "moved_name.py", "fsdp2-then-transformers", "--keep",
                        env=environment(FSDP_AUTOPATCH_LOG="info"))
    first, second = json_lines(known.stdout)
    assert first["at_fsdp2"]["reason"] == "waiting for transformers to be imported"
    both = [f"{FULLY_SHARD_SITE}.fully_shard", f"{DDP_MODULE}.replicate"]
    assert second["at_transformers"]["sites"] == (both if layout_bug_here() else [])
    assert second["at_transformers"]["applied"] is layout_bug_here()
    assert warnings_of(known.stderr) == []


@pytest.mark.ci_tier
def test_replicate_site_that_cannot_be_patched_is_said_once(real_torch: dict[str, str]) -> None:
    result = run_program(PROGRAMS / "moved_name.py", "replicate",
                         env=environment(FSDP_AUTOPATCH_LOG="info", FSDP_AUTOPATCH="force"))
    (status,) = json_lines(result.stdout)
    assert status["applied"] is True
    # Forced, each site is patched as its module finishes importing: composable DDP's first.
    assert sorted(status["sites"]) == [f"{DDP_MODULE}.replicate", f"{FULLY_SHARD_SITE}.fully_shard"]
    (warning,) = warnings_of(result.stderr)
    assert warning.startswith("fsdp-autopatch INFO: FSDP2 replicate runs unpatched: torch ")
    assert "FSDP2 replicate layout is unknown" in warning
    assert warning.removeprefix(CANNOT_RUN_RECORD) in status["reason"]


def test_locks_are_free_in_a_child_forked_while_a_thread_holds_them(installed: Path) -> None:
    """A thread holds the hooks' lock, the patch's lock and the class records' lock when another
    forks: the child, which has no such thread, can still take them all (it would wait forever
    otherwise), through the package's one fork handler."""
    result = run_program(PROGRAMS / "fork_while_locked.py", env=environment(FSDP_AUTOPATCH="0"))
    assert result.stdout.strip() == "0"


@pytest.mark.ci_tier
def test_hooks_register_when_stderr_is_none(installed: Path) -> None:
    """pythonw and some services run with ``sys.stderr = None``: a bad switch value cannot be
    printed, and the patch is armed all the same."""
    result = run_program(IMPORT_BOTH, "--no-stderr", env=environment(FSDP_AUTOPATCH="yes please"))
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"{layout_bug_here()}\n"


@pytest.mark.ci_tier
def test_replicate_import_running_when_the_patch_is_armed_is_patched_when_it_ends(
    real_torch: dict[str, str]
) -> None:
    """``apply()`` (no start-up file) while another thread is inside replicate_with_fsdp's import:
    wrapt calls the hook at once, on the half-run module, and never again; the patch waits for
    that import to finish and then patches replicate()'s site, with no warning."""
    result = run_program(PROGRAMS / "apply_during_replicate_import.py",
                         env=environment(FSDP_AUTOPATCH_LOG="info"))
    (report,) = json_lines(result.stdout)
    assert warnings_of(result.stderr) == []
    if not layout_bug_here():
        assert report["after"]["applied"] is False
        return
    fully_shard, ddp = f"{FULLY_SHARD_SITE}.fully_shard", f"{DDP_MODULE}.replicate"
    assert report["at_apply"]["sites"] == [fully_shard, ddp]
    assert report["after"]["applied"] is True
    replicate = "torch.distributed._composable.replicate_with_fsdp.replicate"
    assert report["after"]["sites"] == [fully_shard, ddp, replicate]


def test_status_says_applied_only_after_the_fix_passed_its_self_check(real_torch: dict[str, str]) -> None:
    """A torch whose fully_shard does not reach the replaced ``type``: the self-check fails, the
    status says fully_shard runs unpatched and why, one warning, and the builtin is back where
    no other site needs the stand-in; composable DDP, which passes, stays patched."""
    result = run_program(PROGRAMS / "calls_a_copy.py", env=environment(FSDP_AUTOPATCH_LOG="info"))
    (report,) = json_lines(result.stdout)
    assert_unpatched_torch(report)
    if not layout_bug_here():  # nothing to patch, so nothing to check
        assert report["status"]["applied"] is False and warnings_of(result.stderr) == []
        return
    status = report["status"]
    assert status["sites"] == [f"{DDP_MODULE}.replicate"] and report["stand_in"] == ["NoneType", 0]
    (warning,) = warnings_of(result.stderr)
    assert warning.startswith("fsdp-autopatch INFO: FSDP2 fully_shard runs unpatched: the fix failed its "
                              "self-check: a throwaway ABC module still fails in torch's construction at "
                              f"{FULLY_SHARD_SITE}.fully_shard: ")
    assert warning.removeprefix("fsdp-autopatch INFO: ") in status["reason"]
    # The same code with torch untouched passes the check.
    untouched = run_program(PROGRAMS / "calls_a_copy.py", "--untouched")
    (report,) = json_lines(untouched.stdout)
    assert report["status"]["applied"] is True and report["error"] is None
    assert report["stand_in"] == ["TypeStandIn", 1]


@pytest.mark.ci_tier
def test_a_decision_that_cannot_tell_is_said(real_torch: dict[str, str]) -> None:
    """A torch newer than the matrix whose construction cannot be probed: not patched; the log
    records it at INFO, and the one line says it by default, since the heads may fail."""
    result = run_program(PROGRAMS / "newer_unprobed.py", env=environment(FSDP_AUTOPATCH_LOG="info"))
    (status,) = json_lines(result.stdout)
    assert status["applied"] is False and status["in_matrix"] is None
    assert "newer than the matrix" in status["reason"] and "could not be probed" in status["reason"]
    assert warnings_of(result.stderr) == [
        f"fsdp-autopatch INFO: not patching (decided by the version matrix): {status['reason']}"]
    # The user reads it by default too, once.
    told = own_lines(run_program(PROGRAMS / "newer_unprobed.py").stderr)
    assert told == [f"fsdp-autopatch: cannot fix the layout bug for ABC modules here: {status['reason']}"]


@pytest.mark.ci_tier
def test_unknown_layout_names_transformers_when_it_is_imported(real_torch: dict[str, str]) -> None:
    moved = run_program(PROGRAMS / "moved_name.py", "transformers-then-fsdp2")
    (status,) = json_lines(moved.stdout)
    assert "FSDP2 layout is unknown" in status["reason"]
    assert status["transformers"] == real_torch["transformers"] and status["torch"] is not None


@pytest.mark.ci_tier
@pytest.mark.parametrize("delay", [0.0, 0.005, 0.01])
def test_apply_while_another_thread_imports_fsdp2(installed: Path, delay: float) -> None:
    path = [str(installed), str(Path(fsdp_autopatch.__file__).parent.parent)]
    result = run_program(PROGRAMS / "apply_during_fsdp2_import.py", str(delay), *path, flags=("-S",))
    (status,) = json_lines(result.stdout)
    assert status["applied"] is layout_bug_here(), status
    assert not status["reason"].startswith("waiting"), status
