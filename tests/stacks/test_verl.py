"""verl's own ``fsdp_utils.apply_fsdp2`` on 2 gloo CPU ranks: a critic (token classification) and a
reward model (sequence classification), and models holding a user's value head whose first base
has empty ``__slots__``, each with verl's ``maybe_patch_fsdp_module`` as shipped or replaced by a
no-op, and the package on or off (FSDP_AUTOPATCH=0)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from stacks.conftest import Claim
from stacks.launch import Run, assert_losses_match_reference, bug_expected, on_ranks

pytestmark = [pytest.mark.stacks, pytest.mark.slow]
LAYOUT = "object layout differs"
# setting: (package on, verl's manager)
SETTINGS = {
    "package alone": (True, "noop"),
    "both": (True, "shipped"),
    "verl's manager alone": (False, "shipped"),
    "neither": (False, "noop"),
}


@pytest.fixture(scope="module")
def verl_runs(tmp_path_factory: pytest.TempPathFactory, installed: Path) -> Callable[[str], dict[str, Any]]:
    """Each setting's run, launched once and shared by the tests: model name -> result line."""
    cache: dict[str, dict[str, Any]] = {}

    def get(setting: str) -> dict[str, Any]:
        if setting not in cache:
            patched, manager = SETTINGS[setting]
            run: Run = on_ranks("rank_verl.py", manager, patched=patched,
                                cwd=tmp_path_factory.mktemp("verl"))
            assert run.error is None, run.error
            assert run.status["applied"] is (patched and bug_expected()), run.status
            cache[setting] = {line["model"]: line for line in run.results}
        return cache[setting]

    return get


def assert_trained(line: dict[str, Any]) -> None:
    assert line.get("sharded") is True, line
    assert_losses_match_reference(line)


def assert_layout_error(line: dict[str, Any]) -> None:
    if bug_expected():
        assert line["sharded"] is False and LAYOUT in line["error"], line
    else:
        assert_trained(line)


def test_apply_fsdp2_critic_and_reward_model(
    verl_runs: Callable[[str], dict[str, Any]], claim: Claim
) -> None:
    for model in ("critic", "reward-model"):
        alone = verl_runs("package alone")[model]
        assert_trained(alone)
        assert alone["unit_bases"][0] != "FSDPModuleABC"
        # verl's own workaround carries its root models by itself.
        verl_only = verl_runs("verl's manager alone")[model]
        assert_trained(verl_only)
        assert verl_only["unit_bases"][0] == "FSDPModuleABC"
        both = verl_runs("both")[model]
        assert_trained(both)
        # Both on: torch builds its class with verl's FSDPModuleABC, which CPython accepts; the
        # package leaves a wrapper that is not torch's own to torch, so verl's class is used.
        assert both["unit_bases"] == verl_only["unit_bases"], (both, verl_only)
        assert both["losses"] == alone["losses"]
        assert_layout_error(verl_runs("neither")[model])
    claim("critic and reward model trained like unsharded copies, with verl's manager replaced by a "
          "no-op and with it as shipped (verl's class is used, as torch alone would)",
          "with verl's manager: works (verl's own workaround); with neither: fails: `object layout differs`")


def test_non_root_abc_module(verl_runs: Callable[[str], dict[str, Any]], claim: Claim) -> None:
    for model in ("abc-head", "generic-head"):
        assert_trained(verl_runs("package alone")[model])
        assert_trained(verl_runs("both")[model])
        assert_layout_error(verl_runs("neither")[model])
    verl_only = verl_runs("verl's manager alone")
    # verl's manager tests isinstance(module, ABC) and builds (ABC, FSDPModule): enough for an
    # abc.ABC head, not for a typing.Generic[T] one.
    assert_trained(verl_only["abc-head"])
    assert_layout_error(verl_only["generic-head"])
    claim("`Head(ABC, nn.Module)` and `Head(Generic[T], nn.Module)` as non-root units trained like "
          "unsharded copies, with or without verl's manager",
          "with verl's manager: the `ABC` head works, the `Generic[T]` head fails: `object layout "
          "differs`; with neither: both fail")
