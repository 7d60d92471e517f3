"""Where torch works unaided, a process with the package is a process with torch alone.

tests/invisible.py runs in fresh interpreters with real torch, transformers and a 1-rank gloo
group, once with the package and once with ``FSDP_AUTOPATCH=0``, and the two reports are compared:
the modules the patch touches (names, star imports, ``eval``, annotations), the classes left in
torch's hierarchies after arming, classes freed once their modules and torch's cache let go,
users' class hooks (a registry, a hook that wraps from another thread and waits), and the status
after a reload. Only the layout error of an ABC-first module differs: the bug, fixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import environment, json_lines, layout_bug_here, run_program

pytestmark = pytest.mark.slow

PROGRAM = Path(__file__).with_name("invisible.py")
# What torch alone does with an ABC-first module, and what the package makes of it.
UNPATCHED, PATCHED = "layout", "wrapped"


def run(part: str, *args: str, **env: str) -> dict[str, Any]:
    # invisible.py begins as tests/prepared.py does: FSDP2, then transformers.
    (report,) = json_lines(run_program(PROGRAM, part, *args, env=environment(**env), prepared=True).stdout)
    return report


def abc_first_outcomes(report: dict[str, Any]) -> list[Any]:
    """The outcomes that differ when the package fixes the bug, taken out of the report."""
    taken = []
    for key in ("replicate abc", "fully_shard abc"):
        taken.append(report["lifetimes"][key].pop("outcomes"))
    for key in ("registry", "hooks"):
        taken += [entry.pop(0) for entry in report[key]]
    taken.append(report.pop("status"))
    return taken


def test_a_process_with_the_package_sees_what_torch_alone_shows(real_torch: dict[str, str]) -> None:
    alone, patched = run("torch-alone", FSDP_AUTOPATCH="0"), run("torch-alone")
    bug = layout_bug_here()
    unaided = UNPATCHED if bug else PATCHED
    assert abc_first_outcomes(alone) == [[unaided]] * 2 + [unaided] * 4 + [False]
    assert abc_first_outcomes(patched) == [[PATCHED]] * 2 + [PATCHED] * 4 + [bug]
    assert patched == alone
    # Not vacuous: the modules were read, every class was freed, and the hooks ran and returned.
    assert len(patched["modules"]) == 4 and all(
        m["eval_type"] == "builtins.type" and not m["binds_type"] for m in patched["modules"].values())
    assert all(entry["alive"] == 0 for entry in patched["lifetimes"].values())
    assert patched["own_classes"] == []
    leftovers = [name for names in patched["subclasses"].values() for name in names
                 if name.rsplit(".", 1)[1] in ("FSDPModule", "DDP") or "SelfCheck" in name]
    assert leftovers == [], "no mirror or self-check class outlives arming"
    assert patched["hooks"] == [[[True]], [[True]]]
    assert patched["registry"][0] == [["DDPRegisteredHead", "RegisteredHead"]]


def test_the_status_says_a_reloaded_site_is_no_longer_patched(real_torch: dict[str, str]) -> None:
    report = run("undone")
    if not layout_bug_here():
        assert report["before"][0] is False
        return
    ddp = "torch.distributed._composable.replicate.replicate"
    assert report["first"] == PATCHED and ddp in report["before"][1]
    applied, sites, reason = report["after"]
    assert applied is True and ddp not in sites and len(sites) == len(report["before"][1]) - 1
    assert ("composable DDP replicate is no longer patched: torch.distributed._composable.replicate was "
            "reloaded, which made a new replicate") in reason
    assert report["reloaded_builder_redirected"] is False


def test_torch_compile_treats_a_compatible_class_as_its_abc_last_twin(real_torch: dict[str, str]) -> None:
    """Slicing a wrapped container, forward, and a step that turns gradient sync off, with the
    eager and aot_eager backends, through FSDP2 and composable DDP: the same outcome, fullgraph
    result, graphs, graph breaks and recompiles; a monkeypatch of the wrapper reaches both."""
    report = run("compile", "eager", "aot_eager")
    for backend, cases in report.items():
        for wrapper in ("replicate", "fully_shard"):
            first, last = cases[f"{wrapper} abc_first"], cases[f"{wrapper} abc_last"]
            # Where torch's own class is refused (the session's probe ran torch's construction
            # with FSDP_AUTOPATCH=0), the ABC-first module got the compatible one; else torch's.
            assert first.pop("wrapped") == PATCHED and last.pop("wrapped") == PATCHED
            assert first.pop("class") == ("compatible" if layout_bug_here() else "torch's")
            assert last.pop("class") == "torch's"
            assert first == last, (backend, wrapper)
            assert first["monkeypatch"] is True and first["forward"]["equal_to_eager"] is True
            assert first["forward"]["graph_breaks"] >= 1, "the counts are read"
