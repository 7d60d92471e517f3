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
from conftest import SCENARIO, environment, json_lines, layout_bug_here, run_python, write_module

pytestmark = pytest.mark.slow

TRIALS = 50
# Two interpreters at a time keep both cores busy; more would only queue.
PARALLEL = 2
# Generous: a trial that has not finished by then is hung, not slow.
TRIAL_TIMEOUT = 300
INSTALLED_LINE = "fsdp-autopatch INFO: patched "  # one per site: fully_shard's, composable DDP's
NOT_PATCHING_LINE = "not patching"

THREADED_IMPORTS = """
import json, sys
sys.path.insert(0, {tests!r})
from scenario import import_in_threads

import_in_threads(seed={seed})  # exits non-zero if an import fails or a thread hangs

import fsdp_autopatch
import torch.distributed.fsdp._fully_shard._fully_shard as site

print(json.dumps({{
    "status": fsdp_autopatch.status().to_dict(),
    "cache": type(site.cls_to_fsdp_cls).__name__,
    "hooks_loaded": "fsdp_autopatch._hooks" in sys.modules,
}}))
"""
# transformers 4.55.3, whose heads no longer inherit abc.ABC: the package loads, and must refuse.
UNAFFECTED_TRANSFORMERS = '__version__ = "4.55.3"\n'


def import_trial(seed: int, **variables: Optional[str]) -> dict[str, Any]:
    """One fresh interpreter racing 16 threads through the first imports; what it reported."""
    # The package logs each install decision at info level: counting those lines counts installs.
    env = environment(FSDP_AUTOPATCH_LOG="info", **variables)
    try:
        code = THREADED_IMPORTS.format(tests=str(SCENARIO.parent), seed=seed)
        result = run_python(code, env=env, timeout=TRIAL_TIMEOUT)
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


SHARD_IN_THREADS = """
import abc, json, threading, types
import torch
import torch.distributed as dist
import torch.distributed.fsdp, transformers
from torch.distributed.fsdp import FSDPModule, fully_shard
import torch.distributed.fsdp._fully_shard._fully_shard as site
import fsdp_autopatch
from fsdp_autopatch import _verify

ROUNDS = {rounds}
COPIES = 2  # models per class: threads race on one class as well as across classes
mesh = _verify.init_process_group()


def user_heads(round_):
    # Fresh classes each round, so every round's first fully_shard misses the class cache.
    def body(namespace):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.linear = torch.nn.Linear(4, 4)

        namespace["__init__"] = __init__
        namespace["forward"] = lambda self, x: self.linear(x)

    return [types.new_class(f"Head{{round_}}x{{k}}", (abc.ABC, torch.nn.Module), exec_body=body)
            for k in range(2)]


def shard_together(models):
    barrier = threading.Barrier(len(models))
    outcomes = [None] * len(models)

    def worker(index):
        barrier.wait()
        try:
            fully_shard(models[index], mesh=mesh)
            outcomes[index] = ""
        except Exception as error:
            outcomes[index] = f"{{type(error).__name__}}: {{error}}"

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


rounds = []
for round_ in range(ROUNDS):
    if round_ == 0:
        # The transformers heads that inherit abc.ABC: two different classes.
        kinds = ["token-classification", "sequence-classification"]
        models = [_verify.build_model(kind) for kind in kinds for _ in range(COPIES)]
    else:
        models = [cls() for cls in user_heads(round_) for _ in range(COPIES)]
    originals = [type(model) for model in models]
    outcomes = shard_together(models)
    by_original = {{}}
    for original, model in zip(originals, models):
        by_original.setdefault(original, set()).add(type(model))
    sharded = all(outcome == "" for outcome in outcomes)
    trained = False
    if sharded and round_ == 0:
        for kind, model in zip(kinds, models[::COPIES]):
            model(**_verify.make_batch(kind, 0)).loss.backward()
        trained = True
    rounds.append({{
        "errors": [outcome for outcome in outcomes if outcome],
        "originals": len(by_original),
        "wrappers_per_original": sorted(len(wrappers) for wrappers in by_original.values()),
        "distinct_wrappers": len(set().union(*by_original.values())),
        "cached": sharded and all(
            site.cls_to_fsdp_cls.get(original) is next(iter(wrappers))
            for original, wrappers in by_original.items()),
        "fsdp_modules": sharded and all(
            isinstance(model, FSDPModule) and type(model).__mro__[2] is original
            for original, model in zip(originals, models)),
        "trained": trained,
    }})
dist.destroy_process_group()
print(json.dumps({{"status": fsdp_autopatch.status().to_dict(), "rounds": rounds}}))
"""


def shard_in_threads(rounds: int, **variables: Optional[str]) -> dict[str, Any]:
    result = run_python(SHARD_IN_THREADS.format(rounds=rounds), env=environment(**variables),
                        timeout=TRIAL_TIMEOUT, prepared=True)
    assert result.returncode == 0, result.stderr[-4000:]
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
