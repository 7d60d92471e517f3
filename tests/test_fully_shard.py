"""fully_shard with the installed patch, on real torch and transformers, in fresh interpreters.

Each claim is checked twice in the same environment: patched (the default) and with
FSDP_AUTOPATCH=0, which must bring torch's original TypeError back wherever this torch and
Python have the bug (``layout_bug_here()``); where they do not (CPython 3.15+), the patch must
stand aside and leave torch's own classes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    AFFECTED,
    LAYOUT_ERROR,
    PROGRAMS,
    assert_trains_like_unsharded,
    ci_tier,
    environment,
    json_lines,
    layout_bug_here,
    run_program,
    run_scenario,
    shard_abc_head,
)
from wrappers import THREE_CALLS, WRAPPERS

from fsdp_autopatch import DDP_MODULE

pytestmark = pytest.mark.slow

DISABLED = environment(FSDP_AUTOPATCH="0")
# fully_shard's site on torch 2.6+, named by the function users call.
FULLY_SHARD_SITE = "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard"


def by_model(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {line["model"]: line for line in lines if "model" in line}


def status_of(lines: list[dict[str, Any]]) -> dict[str, Any]:
    (status,) = [line["status"] for line in lines if "status" in line]
    return status


@pytest.fixture(scope="module")
def unpatched(real_torch: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The proof run with the patch disabled: what torch does on its own."""
    lines = run_scenario(env=DISABLED, prepared=True)
    assert status_of(lines)["applied"] is False
    return by_model(lines)


def assert_bug_without_patch(unpatched: dict[str, dict[str, Any]]) -> None:
    """torch alone fails on the affected heads where the probe says so, and shards them where not."""
    for kind in AFFECTED:
        if layout_bug_here():
            assert unpatched[kind]["sharded"] is False and LAYOUT_ERROR in unpatched[kind]["error"]
        else:
            assert unpatched[kind]["sharded"] and unpatched[kind]["upstream_bases"] is True


def assert_patched_where_needed(status: dict[str, Any]) -> None:
    """Applied where the probe finds the bug; standing aside, and saying why, where not."""
    assert status["decided_by"] == "probe", status
    assert status["applied"] is layout_bug_here(), status
    if layout_bug_here():
        assert status["in_matrix"] is True, status
    else:
        assert "accepts" in status["reason"] and "nothing to patch" in status["reason"], status


# The prepared order in the README's tests; the other two in CI's tier.
@pytest.mark.parametrize("order", ["fsdp-first", *ci_tier("transformers-first", "threads")])
def test_affected_heads_shard_and_train_like_the_unsharded_model(
    order: str, unpatched: dict[str, dict[str, Any]]
) -> None:
    # fsdp-first is the order the prepared interpreter imports them in (tests/programs/prepared.py).
    lines = run_scenario("--order", order, prepared=order == "fsdp-first")
    assert_patched_where_needed(status_of(lines))
    results = by_model(lines)
    for kind in AFFECTED:
        assert_trains_like_unsharded(results[kind])
        # Ours where CPython refuses torch's class; exactly torch's where it accepts it.
        assert results[kind]["upstream_bases"] is not layout_bug_here()
    assert_bug_without_patch(unpatched)


def test_causal_lm_gets_torchs_exact_class(unpatched: dict[str, dict[str, Any]]) -> None:
    patched = by_model(run_scenario("causal-lm", prepared=True))["causal-lm"]
    assert_trains_like_unsharded(patched)
    assert patched["upstream_bases"] is True
    assert patched["wrapper"] == unpatched["causal-lm"]["wrapper"]
    assert_bug_without_patch(unpatched)


def test_users_own_abc_generic_and_collections_abc_modules(real_torch: dict[str, str]) -> None:
    """Per class, CPython decides: torch's class where it accepts it, the package's where not.

    ``Generic[T]`` and ``Protocol`` first are refused on every CPython measured (3.15 too); the ABC and
    collections.abc heads wherever the probe finds the bug. Where it does not, auto mode stands
    aside for the transformers heads, so ``force`` is what covers a user's own Generic module.
    """
    unpatched = run_program(PROGRAMS / "user_modules.py", env=DISABLED, prepared=True)
    (torch_alone,) = json_lines(unpatched.stdout)
    refused = {"AbcHead": layout_bug_here(), "SizedHead": layout_bug_here(), "GenericHead": True,
               "ProtoHead": True}
    for name, bug in refused.items():
        assert ("error" in torch_alone[name]) is bug, (name, torch_alone[name])
        assert not bug or LAYOUT_ERROR in torch_alone[name]["error"]
    assert (LAYOUT_ERROR in torch_alone["slice"]) is layout_bug_here()

    patched = run_program(PROGRAMS / "user_modules.py", env=environment(
        FSDP_AUTOPATCH=None if layout_bug_here() else "force"), prepared=True)
    (report,) = json_lines(patched.stdout)
    for name, bug in refused.items():
        assert report[name] == {
            "aliases": [True, True, True], "fsdp_methods_resolve_to_fsdpmodule": True,
            "original_at_index_2": True, "one_class_per_original": True, "cached": True,
            "deepcopy_guarded": True, "metaclass_as_upstream": True, "upstream_bases": not bug,
        }, name
    # Slicing a sharded container goes through FSDPModule.__new__ and returns the original class.
    assert report["slice"] == "AbcSequential"


NEWER_TRANSFORMERS = "4.57.6"
# The release right after the affected ones: the same heads, without abc.ABC.
FIRST_FIXED_TRANSFORMERS = "4.55.3"


def shadowing_transformers(request: pytest.FixtureRequest, version: str) -> Path:
    """transformers ``version`` in a directory that shadows the environment's own on PYTHONPATH."""
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    if cache is not None:
        target = Path(cache.mkdir(f"transformers-{version}"))
    else:
        target = request.getfixturevalue("tmp_path_factory").mktemp(f"transformers-{version}")
    if not (target / "transformers").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--target", str(target), f"transformers=={version}"],
            check=True, timeout=900,
        )
    return target


@pytest.fixture(scope="session")
def newer_transformers(request: pytest.FixtureRequest, real_torch: dict[str, str]) -> Path:
    """transformers 4.57.6 (no ABC heads), ahead of the environment's own."""
    return shadowing_transformers(request, NEWER_TRANSFORMERS)


@pytest.fixture(scope="session")
def first_fixed_transformers(request: pytest.FixtureRequest, real_torch: dict[str, str]) -> Path:
    """transformers 4.55.3 (its heads dropped abc.ABC), ahead of the environment's own."""
    return shadowing_transformers(request, FIRST_FIXED_TRANSFORMERS)


@pytest.mark.ci_tier
@pytest.mark.parametrize(("mode", "applied"), [(None, False), ("force", True)])
def test_newer_transformers_is_left_alone_unless_forced(
    newer_transformers: Path, mode: str | None, applied: bool
) -> None:
    report = shard_abc_head(FSDP_AUTOPATCH=mode, PYTHONPATH=str(newer_transformers))
    assert report["transformers"] == NEWER_TRANSFORMERS
    assert report["after"]["applied"] is applied, report["after"]
    if applied:
        assert report["error"] is None and "force" in report["after"]["reason"]
    else:
        # Unpatched, a user's own ABC module still hits the bug (where this Python has it):
        # force is the way out.
        assert (report["error"] is not None and LAYOUT_ERROR in report["error"]) is layout_bug_here()
        assert f"transformers {NEWER_TRANSFORMERS} is not affected" in report["after"]["reason"]


@pytest.mark.ci_tier
@pytest.mark.parametrize("position", ["ahead", "behind"])
def test_a_finder_that_asks_every_finder_leaves_the_fix_working(position: str) -> None:
    """Real torch and transformers imported through a finder that asks every finder, the start-up
    watcher included: no recursion, and the fix is there (force mode too) or gone (switched off)."""
    for mode in (None, "force"):
        report = shard_abc_head(finder=position, FSDP_AUTOPATCH=mode)
        assert report["error"] is None
        assert report["after"]["applied"] is (layout_bug_here() or mode == "force")
    error = shard_abc_head(finder=position, FSDP_AUTOPATCH="0")["error"]
    assert (error is not None and LAYOUT_ERROR in error) is layout_bug_here()


def test_status_reports_versions_and_site(real_torch: dict[str, str]) -> None:
    report = shard_abc_head(prepared=True)
    status = report["after"]
    assert report["error"] is None
    assert status["torch"] == real_torch["torch"] or status["torch"].startswith(real_torch["torch"])
    assert status["transformers"] == real_torch["transformers"]
    assert_patched_where_needed(status)
    # FSDP2 imports composable DDP: both are patched.
    sites = [FULLY_SHARD_SITE, f"{DDP_MODULE}.replicate"]
    assert status["sites"] == (sites if layout_bug_here() else [])
    assert json.loads(json.dumps(status)) == status
    error = shard_abc_head(FSDP_AUTOPATCH="0", prepared=True)["error"]
    assert (error is not None and LAYOUT_ERROR in error) is layout_bug_here()


PREFIXES = {"fully_shard": ("FSDP", "FSDPModule"), "DDP replicate": ("DDP", "DDP"),
            "FSDP2 replicate": ("Replicate", "ReplicateModule")}
# What the user's classes' own code may run in a wrapping call, as torch's own type(...) call runs
# it for the class it builds: never an instance's __new__, __init__ or __del__, the metaclass's
# __call__, or a __set_name__ (tests/programs/construction_hooks.py counts each).
NEVER_IN_A_WRAP = ("__new__", "__init__", "__del__", "metaclass __call__", "__set_name__")


@pytest.mark.parametrize("wrapper", list(THREE_CALLS))
def test_construction_hooks_run_once_per_class_as_without_the_patch(wrapper: str) -> None:
    """One class per call, as torch builds it (once per class with fully_shard's and FSDP2
    replicate's caches, once per call with DDP's): a registering ``__init_subclass__`` and a
    counting metaclass see the same constructions patched and unpatched, for an ABC module as for a
    plain one. Where CPython refuses torch's class, the one class built is the compatible one, and
    the module wraps. A mixin and metaclass that count every call of their code see, first or last
    in the bases, exactly what torch's own ``type(...)`` runs, and nothing of an instance's."""
    runs = {}
    for mode in (None, "0"):
        result = run_program(PROGRAMS / "construction_hooks.py", wrapper,
                             env=environment(FSDP_AUTOPATCH=mode), prepared=True)
        (runs[mode],) = json_lines(result.stdout)
    patched, unpatched = runs[None], runs["0"]
    prefix = PREFIXES[wrapper][0]
    per_call = wrapper == "DDP replicate"
    registered = sorted(["AbcBlock", "Block", "HooksFirstBlock", "HooksLastBlock", f"{prefix}Block"])

    def outcomes(name: str) -> list[str]:
        # DDP's second class of the name, built for the second module, is refused by the registry.
        second = f"duplicate registration {prefix}{name}" if per_call else f"{prefix}{name}"
        return [f"{prefix}{name}", second]

    assert patched["Block"] == unpatched["Block"] == {
        "outcomes": outcomes("Block"),
        "built": [f"{prefix}Block"] * (2 if per_call else 1),
        # DDP's second class fails in the registry's __init_subclass__, before the metaclass's __init__.
        "calls": {"metaclass __new__": 2 if per_call else 1, "metaclass __init__": 1},
        "registered": registered,
    }
    for first, last in (("AbcBlock", "Block"), ("HooksFirstBlock", "HooksLastBlock")):
        # torch alone: its <Prefix><Name> is built and registered, then refused by CPython (here).
        assert unpatched[first]["built"] == [f"{prefix}{first}"] * (2 if per_call else 1)
        assert (LAYOUT_ERROR in unpatched[first]["outcomes"][0]) is layout_bug_here()
        assert patched[first] == dict(unpatched[first], outcomes=outcomes(first))
        assert patched[first]["calls"] == patched[last]["calls"], (first, patched[first]["calls"])
    assert patched["HooksLastBlock"] == unpatched["HooksLastBlock"]
    assert patched["HooksLastBlock"]["calls"]["__init_subclass__"] == (2 if per_call else 1)
    assert not any(name in patched[cls]["calls"] for name in NEVER_IN_A_WRAP for cls in patched
                   if cls != "classes")
    # Listed where the package patched (where it stands aside, it lists nothing).
    records = [c["outcome"] for c in patched["classes"] if c["name"] == "AbcBlock"]
    assert records == (["compatible"] if layout_bug_here() else [])
    if layout_bug_here():
        assert {c["name"]: c["outcome"] for c in patched["classes"]}["Block"] == "torch"


@pytest.mark.ci_tier
@pytest.mark.parametrize("order", ["transformers", "force"])
def test_a_class_that_failed_before_the_patch_shards_after_it(order: str, newer_transformers: Path) -> None:
    """torch stores its refused ``FSDP<Name>`` before the swap fails; installing the patch
    drops that entry, so the class gets a compatible one on its next ``fully_shard``."""
    env = {} if order == "transformers" else {"PYTHONPATH": str(newer_transformers)}
    reports = {}
    for mode in (None, "0"):
        result = run_program(PROGRAMS / "stale_entry.py", order,
                            env=environment(FSDP_AUTOPATCH=mode, **env))
        (reports[mode],) = json_lines(result.stdout)
    patched, unpatched = reports[None], reports["0"]
    if not layout_bug_here():
        assert patched["after"] == unpatched["after"] == "FSDPHead"
        return
    for report in (patched, unpatched):
        assert LAYOUT_ERROR in report["before"] and report["cached_before"] is True
    assert LAYOUT_ERROR in unpatched["after"]
    if order == "force":
        assert patched["auto"]["applied"] is False and "not affected" in patched["auto"]["reason"]
    assert patched["after"] == "FSDPHead" and patched["status"]["applied"] is True
    (record,) = patched["status"]["classes"]
    assert (record["name"], record["outcome"], record["parent"]) == ("Head", "compatible", "abc.ABC")


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_monkeypatches_of_the_wrapper_reach_abc_modules_as_they_reach_others(wrapper: str) -> None:
    """A profiler or ``monkeypatch`` replacing ``FSDPModule.reshard`` (or a method of composable
    DDP's ``DDP``): ABC modules (wrapped before or after) call the replacement as plain modules
    do, go back with it, and lose it with it."""
    script = PROGRAMS / "monkeypatched.py"
    result = run_program(script, wrapper, prepared=True)
    (report,) = json_lines(result.stdout)
    prefix = PREFIXES[wrapper][0]
    assert report == {
        "before": ["torch's method"] * 2,
        "replaced": [f"traced {prefix}Plain", f"traced {prefix}Head", f"traced {prefix}Late"],
        "restored": ["torch's method"] * 3,
        "deleted": ["no method"] * 3,
        "hasattr": [False] * 3,
    }, report
    unpatched = run_program(script, wrapper, env=DISABLED, prepared=True)
    (alone,) = json_lines(unpatched.stdout)
    assert alone["replaced"][0] == f"traced {prefix}Plain"
    assert (alone["replaced"][1:] == ["not sharded"] * 2) is layout_bug_here()


@pytest.mark.ci_tier
def test_status_lists_each_class_that_went_through_the_patched_site() -> None:
    result = run_program(PROGRAMS / "classes_of_a_run.py", env=environment(FSDP_AUTOPATCH_LOG="debug"))
    (report,) = json_lines(result.stdout)
    status = report["heads"]
    assert json.loads(json.dumps(status)) == status
    if not layout_bug_here():  # standing aside: nothing went through a patched site
        assert status["classes"] == [] and status["classes_seen"] == 0
        return
    site = FULLY_SHARD_SITE
    module = "transformers.models.qwen2.modeling_qwen2"
    assert status["classes"] == [
        {"name": "Qwen2DecoderLayer", "module": module, "site": site, "wrapper": "FSDPQwen2DecoderLayer",
         "outcome": "torch", "parent": None, "reason": None},
        {"name": "Qwen2ForTokenClassification", "module": module, "site": site,
         "wrapper": "FSDPQwen2ForTokenClassification", "outcome": "compatible", "parent": "abc.ABC",
         "reason": None},
        {"name": "Qwen2ForCausalLM", "module": module, "site": site, "wrapper": "FSDPQwen2ForCausalLM",
         "outcome": "torch", "parent": None, "reason": None},
    ]
    assert status["classes_seen"] == 3
    many = report["many"]
    assert many == {"kept": many["limit"], "seen": 3 + many["limit"] + 20, "limit": many["limit"]}
    # The log says it once per class, at the level of what happened.
    log = [line for line in result.stderr.splitlines() if line.startswith("fsdp-autopatch")]
    assert sum("built FSDPQwen2ForTokenClassification on abc.ABC" in line for line in log) == 1
    assert sum("left transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer to torch" in line
               for line in log) == 1


@pytest.mark.ci_tier
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_classes_with_creation_side_effects_match_torch_alone(
    first_fixed_transformers: Path, wrapper: str
) -> None:
    """Patched, with ``FSDP_AUTOPATCH=0``, and beside transformers 4.55.3 (whose heads need no
    patch): a plain class sees the same side effects and outcome in all three. An ABC class
    is wrapped patched as it is with the patch forced beside 4.55.3, with the side effects of
    its plain twin, and fails without it."""
    fixed = {"PYTHONPATH": str(first_fixed_transformers)}
    runs = {}
    for label, env in {"patched": {}, "disabled": {"FSDP_AUTOPATCH": "0"}, "fixed": fixed,
                       "fixed-forced": dict(fixed, FSDP_AUTOPATCH="force")}.items():
        result = run_program(PROGRAMS / "side_effects.py", wrapper, env=environment(**env), prepared=True)
        (runs[label],) = json_lines(result.stdout)
    bug = layout_bug_here()
    assert [runs[label]["applied"] for label in runs] == [bug, False, False, True]
    plain = runs["patched"]["Plain"]
    for label in runs:
        assert runs[label]["Plain"] == plain, label
    prefix, name = PREFIXES[wrapper]
    per_call = 2 if wrapper == "DDP replicate" else 1  # DDP builds a class per call, FSDP2 caches it
    assert plain["outcome"] == {
        "class": f"{prefix}Plain", "mro": [f"{prefix}Plain", name, "Plain"], "is_fsdp": True,
        "named": f"named on {prefix}Plain", "stamp": f"{prefix}Plain",
        "describe": [f"{prefix}Plain", name, "Plain"], "size": [4, 4], "output": [1, 4],
        "registered": per_call,
    }
    # torch's constructions: the metaclass decorates each, __init_subclass__ runs once for each.
    assert plain["events"] == [f"init_subclass {prefix}Plain", f"decorated {prefix}Plain"] * per_call + [
        f"described {prefix}Plain", f"cached_property on {prefix}Plain"]
    head = runs["patched"]["Head"]
    assert runs["fixed-forced"]["Head"] == head
    assert runs["disabled"]["Head"] == runs["fixed"]["Head"]
    if not bug:
        assert head == runs["disabled"]["Head"]
        return
    assert LAYOUT_ERROR in runs["disabled"]["Head"]["outcome"]["error"]
    # The first base is the wrapper's mirror on abc.ABC; the rest is as for the plain twin.
    assert head["outcome"] == dict(plain["outcome"], **{
        "class": f"{prefix}Head", "mro": [f"{prefix}Head", f"ABC{name}", "Head"],
        "named": f"named on {prefix}Head", "stamp": f"{prefix}Head",
        "describe": [f"{prefix}Head", f"ABC{name}", "Head"], "registered": per_call,
    })
    # One construction per class torch builds, with its side effects, as for the plain twin.
    assert head["events"] == [f"init_subclass {prefix}Head", f"decorated {prefix}Head"] * per_call + [
        f"described {prefix}Head", f"cached_property on {prefix}Head"]


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_class_whose_construction_shards_another_module(wrapper: str) -> None:
    """No deadlock where torch has none: the construction of ``FSDPOuter`` (``DDPOuter``) wraps
    an ``Inner`` from ``__init_subclass__``, patched as without the patch."""
    for mode in (None, "0"):
        result = run_program(PROGRAMS / "shards_while_built.py", wrapper,
                             env=environment(FSDP_AUTOPATCH=mode), timeout=120, prepared=True)
        assert json_lines(result.stdout) == [{"outer": f"{PREFIXES[wrapper][0]}Outer"}]


def test_readers_of_torchs_class_caches_see_torchs_dict() -> None:
    """``get_cls_to_fsdp_cls().get(Plain)`` for a class never sharded is None (or the default), and
    builds nothing; every other read behaves as on torch's dict, patched as with the patch off.
    After sharding, the cache holds what torch's construction stored: the ABC class's compatible
    class where CPython refuses torch's, the plain class's own."""
    runs = {}
    for mode in (None, "0"):
        result = run_program(PROGRAMS / "cache_readers.py", env=environment(FSDP_AUTOPATCH=mode),
                             prepared=True)
        (runs[mode],) = json_lines(result.stdout)
    patched, unpatched = runs[None], runs["0"]
    assert patched["applied"] is layout_bug_here() and unpatched["applied"] is False
    for name in ("cls_to_fsdp_cls", "cls_to_replicate_cls"):
        assert patched[name] == unpatched[name] == {
            "type": "dict", "get": "None", "default": "default", "in": False, "item": "KeyError", "len": 0,
            "iter": [], "copy": "dict", "dict": 0, "after": 0,
        }
    assert patched.get("getter") == unpatched.get("getter")
    if "getter" in patched:
        assert patched["getter"] == [True, "default", 0]
    # torch stores its failed class too, before CPython refuses the swap.
    assert patched["after sharding"] == unpatched["after sharding"] == {
        "type": "dict", "keys": ["Head", "Plain"], "values": ["FSDPHead", "FSDPPlain"]}
