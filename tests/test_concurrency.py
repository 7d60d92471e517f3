"""Threads: imports racing the start-up watcher and the hooks, and fully_shard racing itself.

Training code imports torch and transformers from data-loader workers, tokenizer threads and the
main thread at once, and shards modules from several threads. The patch must be installed once,
never deadlock an import, and build exactly one wrapper class per original class.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import PROGRAMS, environment, json_lines, layout_bug_here, run_program, write_module

pytestmark = pytest.mark.slow

TRIALS = 50
# Two interpreters at a time keep both cores busy; more would only queue.
PARALLEL = 2
# Generous: a trial that has not finished by then is hung, not slow.
TRIAL_TIMEOUT = 300
# The package logs each site patched, and the decision, at DEBUG: counting those lines counts
# installs and refusals.
INSTALLED_LINE = "fsdp-autopatch DEBUG: patched "  # one per site: fully_shard's, composable DDP's
NOT_PATCHING_LINE = "fsdp-autopatch DEBUG: not patching"

# transformers 4.55.3, whose heads no longer inherit abc.ABC: the package loads, and must refuse.
UNAFFECTED_TRANSFORMERS = '__version__ = "4.55.3"\n'


def import_trial(seed: int, **variables: Optional[str]) -> dict[str, Any]:
    """One fresh interpreter racing 16 threads through the first imports; what it reported."""
    env = environment(FSDP_AUTOPATCH_LOG="debug", **variables)
    try:
        result = run_program(PROGRAMS / "threaded_imports.py", str(seed), env=env, timeout=TRIAL_TIMEOUT,
                             check=False)
    except subprocess.TimeoutExpired:
        return {"seed": seed, "problem": f"hung: no exit within {TRIAL_TIMEOUT} s (deadlock?)"}
    if result.returncode != 0:
        return {"seed": seed, "problem": f"exit {result.returncode}: {result.stderr[-2000:]}"}
    (report,) = json_lines(result.stdout)
    report.update(
        seed=seed,
        installs=result.stderr.count(INSTALLED_LINE),
        refusals=result.stderr.count(NOT_PATCHING_LINE),
        problem="",
    )
    return report


def test_threaded_first_imports_install_once(real_torch: dict[str, str]) -> None:
    """Installed exactly once; where this torch and Python have no bug, refused exactly once."""
    bug = layout_bug_here()
    with ThreadPoolExecutor(PARALLEL) as pool:
        reports = list(pool.map(import_trial, range(TRIALS)))
    failures = []
    for report in reports:
        if report["problem"]:
            failures.append(report)
            continue
        status = report["status"]
        good = (
            report["refusals"] == (0 if bug else 1)
            and status["applied"] is bug
            and report["installs"] == len(status["sites"]) == len(set(status["sites"]))
            and any(site.endswith("._fully_shard.fully_shard") for site in status["sites"]) is bug
            and report["cache"] == "dict"
        )
        if not good:
            failures.append(report)
    assert failures == [], f"{len(failures)} of {TRIALS} trials went wrong, e.g. {failures[:3]}"


def test_threaded_first_imports_refuse_once(tmp_path: Path, real_torch: dict[str, str]) -> None:
    """The same race, armed, with a transformers the bug never reached: decided once, not patched.

    A stand-in transformers package (its version is all the decision reads) is put ahead of the
    real one with PYTHONPATH, which costs nothing to install.
    """
    write_module(tmp_path, "transformers", UNAFFECTED_TRANSFORMERS)
    trials = TRIALS // 5
    with ThreadPoolExecutor(PARALLEL) as pool:
        reports = list(pool.map(lambda seed: import_trial(seed, PYTHONPATH=str(tmp_path)), range(trials)))
    failures = []
    for report in reports:
        status = report.get("status", {})
        good = (
            report["problem"] == ""
            and report["hooks_loaded"]
            and report["installs"] == 0
            and report["refusals"] == 1
            and not status["applied"]
            and status["transformers"] == "4.55.3"
            and "4.55.3" in status["reason"]
            and report["cache"] == "dict"
        )
        if not good:
            failures.append(report)
    assert failures == [], f"{len(failures)} of {trials} trials went wrong, e.g. {failures[:3]}"




def shard_in_threads(rounds: int, **variables: Optional[str]) -> dict[str, Any]:
    result = run_program(PROGRAMS / "shard_in_threads.py", str(rounds), env=environment(**variables),
                         timeout=TRIAL_TIMEOUT, prepared=True)
    (report,) = json_lines(result.stdout)
    return report


def test_fully_shard_from_threads_builds_one_class_per_original(real_torch: dict[str, str]) -> None:
    report = shard_in_threads(rounds=12)
    assert report["status"]["applied"] is layout_bug_here()
    for number, round_ in enumerate(report["rounds"]):
        assert round_["errors"] == [], (number, round_)
        # Two originals, each shared by two racing threads: one class each, and not the same one.
        assert round_["originals"] == 2 and round_["wrappers_per_original"] == [1, 1], (number, round_)
        assert round_["distinct_wrappers"] == 2, (number, round_)
        assert round_["cached"] and round_["fsdp_modules"], (number, round_)
    assert report["rounds"][0]["trained"]
    # The same program with the package off: every thread hits the layout error, where there is one.
    off = shard_in_threads(rounds=2, FSDP_AUTOPATCH="0")
    assert not off["status"]["applied"]
    for round_ in off["rounds"]:
        if layout_bug_here():
            assert len(round_["errors"]) == 4
            assert all("__class__ assignment" in error for error in round_["errors"]), round_
        else:
            assert round_["errors"] == [], round_
