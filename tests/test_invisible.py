"""Where torch works unaided, a process with the package is a process with torch alone.

tests/programs/invisible.py runs in fresh interpreters with real torch, transformers and a 1-rank gloo
group, once with the package and once with ``FSDP_AUTOPATCH=0``, and the two reports are compared:
the modules the patch touches (names, star imports, ``eval``, annotations), the classes left in
torch's hierarchies after arming, classes freed once their modules and torch's cache let go,
users' class hooks (a registry, a hook that wraps from another thread and waits), and the status
after a reload. Only the layout error of an ABC-first module differs: the bug, fixed.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import PROGRAMS, environment, json_lines, layout_bug_here, run_program

pytestmark = pytest.mark.slow

PROGRAM = PROGRAMS / "invisible.py"
# What torch alone does with an ABC-first module, and what the package makes of it.
UNPATCHED, PATCHED = "layout", "wrapped"


def run(part: str, *args: str, **env: str) -> dict[str, Any]:
    # invisible.py begins as tests/programs/prepared.py does: FSDP2, then transformers.
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


IDENTITY = PROGRAMS / "identity_classes.py"


@pytest.mark.ci_tier
def test_classes_are_told_apart_by_identity_never_by_a_metaclass_eq_or_hash(
    real_torch: dict[str, str]
) -> None:
    """Two classes named Head whose metaclass makes them equal, then a Head needing the fix and
    one not, and a plain module that cannot be hashed, through every wrapper: as torch alone
    treats their ABC-last twins. (FSDP2's own class cache compares by ``==``: a second ``Head``
    gets the first's wrapper class from it, torch's doing, as for the twins.)"""
    def classes(*args: str, **env: str) -> dict[str, Any]:
        (report,) = json_lines(run_program(IDENTITY, *args, env=environment(**env)).stdout)
        return report

    twins_alone, twins = classes("--abc-last", FSDP_AUTOPATCH="0"), classes("--abc-last")
    assert twins == twins_alone
    heads = classes()
    cached = ("fully_shard", "FSDP2 replicate")  # the wrappers with a class cache of torch's
    for wrapper in cached:
        # torch's cache hands the first Head's class to the second: for the twin it fits; for an
        # ABC-last Head after an ABC-first one it is the compatible class, whose layout does not.
        first, second = heads[wrapper]["abc then plain"]
        assert first == twins[wrapper]["abc then plain"][0]
        assert second == ({"wrapped": False, "error": "layout"} if layout_bug_here()
                          else twins[wrapper]["abc then plain"][1])
        del heads[wrapper]["abc then plain"], twins[wrapper]["abc then plain"]
    assert heads == twins
    # Not vacuous: without a cache each module runs its own class's forward, the unhashable
    # plain module wraps (torch's cache cannot hash it), and the cache conflates the two Heads.
    assert [entry["forward"] for entry in heads["DDP replicate"]["same name"]] == ["model_a", "model_b"]
    assert heads["DDP replicate"]["unhashable"] == [{"forward": "plain", "own_class_in_mro": True,
                                                     "wrapped": True}]
    assert heads["fully_shard"]["unhashable"][0]["wrapped"] is False
    assert [entry["forward"] for entry in heads["fully_shard"]["same name"]] == ["model_a", "model_a"]


def test_a_compatible_class_takes_the_namespace_torch_passes_in_that_call(real_torch: dict[str, str]) -> None:
    """A deep-copy stub rebound after the imports is on the ABC-first head's class as on its twin's."""
    def report(**env: str) -> dict[str, Any]:
        program = PROGRAMS / "namespace_of_the_call.py"
        (found,) = json_lines(run_program(program, env=environment(**env), prepared=True).stdout)
        return found

    patched, alone = report(), report(FSDP_AUTOPATCH="0")
    assert patched == {f"{wrapper} {head}": True for wrapper in ("fully_shard", "DDP replicate")
                       for head in ("abc first", "abc last")}
    # torch alone: the twins hold it; the ABC-first heads fail where the bug is.
    for wrapper in ("fully_shard", "DDP replicate"):
        assert alone[f"{wrapper} abc last"] is True
        assert (alone[f"{wrapper} abc first"] is True) is not layout_bug_here()


def test_a_users_class_hook_meets_torchs_frames_and_one_of_the_package(real_torch: dict[str, str]) -> None:
    """An error a user's ``__init_subclass__`` raises in torch's call carries the traceback torch
    alone shows, and one frame of the package's: the stand-in for ``type`` torch's code calls
    (docs/how-it-works.md#limits), which a ``stacklevel=2`` warning names too."""
    def report(**env: str) -> dict[str, Any]:
        program = PROGRAMS / "refusing_hook.py"
        (found,) = json_lines(run_program(program, env=environment(**env), prepared=True).stdout)
        return found

    patched, alone = report(), report(FSDP_AUTOPATCH="0")
    for wrapper in ("fully_shard", "DDP replicate"):
        frames, hook = patched[wrapper]["frames"], ["refusing_hook.py", "__init_subclass__"]
        own = [frame for frame in frames if frame[0] in ("_patch.py", "_classes.py", "_hooks.py")]
        assert own == ([["_patch.py", "__call__"]] if layout_bug_here() else []), frames
        assert [frame for frame in frames if frame not in own] == alone[wrapper]["frames"]
        assert frames[-1] == hook and frames[-2 - len(own)][0] in ("_fsdp_init.py", "replicate.py")
        assert alone[wrapper]["warned_in"] == [frames[-2 - len(own)][0]]
        # type() is called by the fix, where torch with upstream/torch.diff calls it too.
        warned = ["_wrapper_cls.py"] if layout_bug_here() else alone[wrapper]["warned_in"]
        assert patched[wrapper]["warned_in"] == warned


@pytest.mark.ci_tier
def test_cprofile_lists_torchs_builder_as_torch_alone_does(real_torch: dict[str, str]) -> None:
    """torch 2.11+'s shared builder, under cProfile: called by fully_shard twice, as without the
    package; the probe and the self-check run its code under a label of their own."""
    def report(**env: str) -> dict[str, Any]:
        program = PROGRAMS / "profiled.py"
        (found,) = json_lines(run_program(program, env=environment(**env)).stdout)
        return found

    alone, patched = report(FSDP_AUTOPATCH="0"), report()
    assert len(alone) == 1 and list(alone.values()) == [{"calls": 2, "callers": ["fully_shard"]}], alone
    torchs = {label: entry for label, entry in patched.items() if "fsdp-autopatch" not in label}
    assert torchs == alone
    checks = sorted(label.rsplit(":", 1)[1] for label in patched if label not in torchs)
    probe, check = "_apply_to_module (fsdp-autopatch probe)", "_apply_to_module (fsdp-autopatch self-check)"
    assert checks == ([probe, check] if layout_bug_here() else [probe])
