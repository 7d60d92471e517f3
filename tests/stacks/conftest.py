"""Collect the stacks tests only when asked for, record what each one showed, write the table.

The default ``tests`` session must not pay for (or need) accelerate, TRL, PEFT, datasets and verl,
so the test modules here are collected only with ``FSDP_AUTOPATCH_STACKS=1`` (the ``stacks``
nox session sets it) or an ``-m`` expression that selects ``stacks``.

Each test fills the ``claim`` fixture with what it showed with and without the patch; after the
run, ``readme_table`` renders the "Works with" table from those claims and the outcomes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from stacks import readme_table

ENABLE = "FSDP_AUTOPATCH_STACKS"
HERE = Path(__file__).resolve().parent
_RESULTS = pytest.StashKey[dict[str, dict[str, Any]]]()
_CLAIM = pytest.StashKey["Claim"]()
_WRITTEN = pytest.StashKey[str]()
_STARTED = pytest.StashKey[float]()


def _enabled(config: pytest.Config) -> bool:
    if os.environ.get(ENABLE, "").strip() not in ("", "0"):
        return True
    expression = config.getoption("markexpr", "") or ""
    return "stacks" in expression and "not stacks" not in expression


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> Optional[bool]:
    if collection_path.parent == HERE and collection_path.name.startswith("test_") and not _enabled(config):
        return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "stacks_ci: the stacks cases CI runs (accelerate, DCP, torch.compile, Ray)")
    config.stash[_RESULTS] = {}


class Claim:
    """What a test showed, in the README's words: with the patch, and with FSDP_AUTOPATCH=0."""

    def __init__(self) -> None:
        self.with_patch = ""
        self.without_patch = ""

    def __call__(self, with_patch: str, without_patch: str) -> None:
        self.with_patch, self.without_patch = with_patch, without_patch


@pytest.fixture
def claim(request: pytest.FixtureRequest) -> Claim:
    found = Claim()
    request.node.stash[_CLAIM] = found
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if item.path.parent != HERE:
        return report
    results = item.config.stash[_RESULTS]
    if report.when == "call" or report.outcome != "passed":
        found = item.stash.get(_CLAIM, None)
        entry = results.setdefault(item.nodeid, {"outcome": report.outcome})
        if entry["outcome"] == "passed" or report.when == "call":
            entry["outcome"] = report.outcome
        if found is not None:
            entry.update(with_patch=found.with_patch, without_patch=found.without_patch)
    return report


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()


def pytest_sessionfinish(session: pytest.Session) -> None:
    results = session.config.stash.get(_RESULTS, {})
    if results:
        seconds = time.monotonic() - session.config.stash.get(_STARTED, time.monotonic())
        session.config.stash[_WRITTEN] = readme_table.publish(readme_table.describe_run(results, seconds))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    written = config.stash.get(_WRITTEN, None)
    if written:
        terminalreporter.write_line(f"stacks table: {written}")
