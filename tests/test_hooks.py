"""The hooks: when the patch is installed, what it says, and that it happens once; the probe
that decides whether it is needed, run on real torch.

Fresh interpreters of the installed package, with real torch and transformers. Import orders and
threads are covered with the full proof in test_fully_shard.py. Where this torch and Python have
no layout bug (``layout_bug_here()`` is False, as on CPython 3.15), the same tests check that the
patch stands aside.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
from conftest import (
    LAYOUT_ERROR,
    environment,
    json_lines,
    layout_bug_here,
    own_lines,
    run_python,
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


def test_force_mode_patches_whatever_the_versions(installed: Path) -> None:
    report = shard_abc_head(FSDP_AUTOPATCH="force")
    assert report["before"]["applied"] is True and report["before"]["mode"] == "force"
    assert report["before"]["decided_by"] is None
    assert "force" in report["before"]["reason"] and report["error"] is None


IMPORT_BOTH = (
    "import torch.distributed.fsdp, transformers, fsdp_autopatch; print(fsdp_autopatch.status().applied)"
)


def test_silent_by_default_and_one_info_line_when_asked(real_torch: dict[str, str]) -> None:
    quiet = run_python(IMPORT_BOTH)
    assert quiet.stdout == f"{layout_bug_here()}\n" and own_lines(quiet.stderr) == []
    told = run_python(IMPORT_BOTH, env=environment(FSDP_AUTOPATCH_LOG="info"))
    lines = own_lines(told.stderr)
    # One line per site patched (FSDP2 imports composable DDP too), or one saying why not.
    actions = (["patched FSDP2 fully_shard for ABC-based modules at ",
                "patched composable DDP replicate for ABC-based modules at "]
               if layout_bug_here() else ["not patching"])
    assert len(lines) == len(actions)
    for line, action in zip(lines, actions):
        assert line.startswith(f"fsdp-autopatch INFO: {action}")
        assert f"transformers {real_torch['transformers']}" in line
        assert "(decided by the probe)" in line and "(probed)" in line


@pytest.mark.parametrize("value", ["yes please", "ünïcødé", "$(rm -rf ~) ; `id` | &", "x" * 5000])
def test_bad_switch_value_warns_once_and_runs_in_auto_mode(installed: Path, value: str) -> None:
    result = run_python(IMPORT_BOTH, env=environment(FSDP_AUTOPATCH=value))
    assert result.returncode == 0 and result.stdout == f"{layout_bug_here()}\n"
    (line,) = own_lines(result.stderr)
    assert line.startswith("fsdp-autopatch: ignoring FSDP_AUTOPATCH=") and len(line) < 300
    assert "0|off|false|no|disable" in line


# The package's probe next to the real thing: fully_shard, unpatched, on a class (ABC, nn.Module).
PROBE_AND_SHARD = """
    import abc, json, sys
    import torch.distributed.fsdp
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard import _fully_shard
    from fsdp_autopatch import _patch, _sites, _verify

    report = {"helper": _patch.probe_layout_bug()}
    report["cache_untouched"] = not any(
        "LayoutProbe" in cls.__name__ for cls in _fully_shard.cls_to_fsdp_cls)
    # Composable DDP builds its class inline, as torch 2.4 - 2.10's fully_shard does.
    report["inline"] = _patch.probe_layout_bug(_patch.resolve_api(_sites.DDP_REPLICATE))
    helper = _fully_shard._apply_to_module
    # A helper that wants an argument the package does not know: it cannot tell, and says so.
    def unknown(modules, cls_to_wrapper_cls, wrapper_module_cls, wrapper_cls_prefix,
                unimplemented_deepcopy, placement):
        raise AssertionError("never called")
    _fully_shard._apply_to_module = unknown
    report["unknown_signature"] = _patch.probe_layout_bug()
    # Keyword-only and reordered parameters are matched by name, not position.
    def reordered(*, unimplemented_deepcopy, wrapper_cls_prefix, wrapper_module_cls,
                  cls_to_wrapper_cls, modules, extra=None):
        return helper(modules, cls_to_wrapper_cls, wrapper_module_cls, wrapper_cls_prefix,
                      unimplemented_deepcopy)
    _fully_shard._apply_to_module = reordered
    report["reordered"] = _patch.probe_layout_bug()
    _fully_shard._apply_to_module = helper

    class Head(abc.ABC, nn.Linear):
        pass

    try:
        fully_shard(Head(4, 4), mesh=_verify.init_process_group())
        report["error"] = None
    except TypeError as error:
        report["error"] = str(error)
    print(json.dumps(report))
"""


def test_probe_answers_what_fully_shard_does(real_torch: dict[str, str]) -> None:
    """The real probe on real torch says "bug" exactly where fully_shard, unpatched, fails on an
    ABC module; through torch's helper or an inline construction alike; and it leaves torch's
    cache alone."""
    result = run_python(PROBE_AND_SHARD, env=environment(FSDP_AUTOPATCH="0"), prepared=True)
    assert result.returncode == 0, result.stderr[-4000:]
    (report,) = json_lines(result.stdout)
    bug = report["error"] is not None and LAYOUT_ERROR in report["error"]
    assert report["error"] is None or bug, report["error"]
    assert report["helper"] is bug and report["inline"] is bug and report["reordered"] is bug
    assert report["unknown_signature"] is None
    assert report["cache_untouched"] is True
    assert layout_bug_here() is bug


# Code that defines ``intercept(name, before, after)``: the module ``name`` is then imported by its
# own loader with ``before(module)`` and ``after(module)`` called around it, on whichever thread
# imports it, before any post-import hook sees the module.
INTERCEPT_IMPORT = textwrap.dedent("""
    import importlib.machinery, sys

    def intercept(name, before=lambda module: None, after=lambda module: None):
        class Intercepting:
            def find_spec(self, fullname, path=None, target=None):
                if fullname != name:
                    return None
                spec = importlib.machinery.PathFinder.find_spec(fullname, path)
                real = spec.loader

                class Loader:
                    def create_module(self, spec):
                        return None

                    def exec_module(self, module):
                        before(module)
                        real.exec_module(module)
                        after(module)

                spec.loader = Loader()
                return spec

        sys.meta_path.insert(0, Intercepting())
""")
FULLY_SHARD_SITE = "torch.distributed.fsdp._fully_shard._fully_shard"


def with_name_moved(module: str, name: str, code: str) -> str:
    """``code`` run after ``module``'s global ``name`` is renamed once it has run, as a torch that
    moved it would."""
    move = (f"intercept({module!r}, after=lambda module: "
            f"setattr(module, 'moved_elsewhere', module.__dict__.pop({name!r})))\n")
    return INTERCEPT_IMPORT + move + textwrap.dedent(code)


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("fsdp-autopatch WARNING")]


def test_unknown_fsdp2_layout_is_said_within_the_import(real_torch: dict[str, str]) -> None:
    """FSDP2 imported, ``fully_shard`` there, none of the known sites: the status says so within
    that import, with one warning; composable DDP, imported with it, is still patched once
    transformers is there."""
    code = """
        import json
        import torch, torch.distributed.fsdp
        import fsdp_autopatch
        print(json.dumps({"at_fsdp2": fsdp_autopatch.status().to_dict()}))
        import transformers
        print(json.dumps({"at_transformers": fsdp_autopatch.status().to_dict()}))
    """
    moved = run_python(with_name_moved(FULLY_SHARD_SITE, "_unimplemented_deepcopy", code),
                       env=environment(FSDP_AUTOPATCH_LOG="warning"))
    assert moved.returncode == 0, moved.stderr[-4000:]
    first, second = json_lines(moved.stdout)
    status = first["at_fsdp2"]
    (warning,) = warnings_of(moved.stderr)
    expected = warning.removeprefix("fsdp-autopatch WARNING: ")
    from fsdp_autopatch import __version__

    assert expected.startswith("FSDP2 fully_shard runs unpatched: torch ")
    assert f"'s FSDP2 layout is unknown to fsdp-autopatch {__version__}" in expected
    assert "upgrade fsdp-autopatch" in expected and "FSDP_AUTOPATCH=0" in expected
    assert status["applied"] is False and status["reason"].endswith(f"; {expected}")
    assert status["transformers"] is None
    after = second["at_transformers"]
    assert after["transformers"] == real_torch["transformers"] and after["reason"].endswith(f"; {expected}")
    assert after["sites"] == ([f"{DDP_MODULE}.replicate"] if layout_bug_here() else [])

    # The same process with torch's names where they are: waiting for transformers, silent.
    known = run_python(code, env=environment(FSDP_AUTOPATCH_LOG="warning"))
    assert known.returncode == 0, known.stderr[-4000:]
    first, second = json_lines(known.stdout)
    assert first["at_fsdp2"]["reason"] == "waiting for transformers to be imported"
    both = [f"{FULLY_SHARD_SITE}.fully_shard", f"{DDP_MODULE}.replicate"]
    assert second["at_transformers"]["sites"] == (both if layout_bug_here() else [])
    assert second["at_transformers"]["applied"] is layout_bug_here()
    assert warnings_of(known.stderr) == []


def test_replicate_site_that_cannot_be_patched_is_said_once(real_torch: dict[str, str]) -> None:
    code = """
        import json
        import torch.distributed.fsdp, transformers
        import torch.distributed._composable.replicate_with_fsdp
        import fsdp_autopatch
        fsdp_autopatch.apply()
        print(json.dumps(fsdp_autopatch.status().to_dict()))
    """
    result = run_python(
        with_name_moved("torch.distributed._composable.replicate_with_fsdp", "_unimplemented_deepcopy", code),
        env=environment(FSDP_AUTOPATCH_LOG="warning", FSDP_AUTOPATCH="force"),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (status,) = json_lines(result.stdout)
    assert status["applied"] is True
    # Forced, each site is patched as its module finishes importing: composable DDP's first.
    assert sorted(status["sites"]) == [f"{DDP_MODULE}.replicate", f"{FULLY_SHARD_SITE}.fully_shard"]
    (warning,) = warnings_of(result.stderr)
    assert warning.startswith("fsdp-autopatch WARNING: FSDP2 replicate runs unpatched: torch ")
    assert "FSDP2 replicate layout is unknown" in warning
    assert warning.split("WARNING: ")[1] in status["reason"]


def test_locks_are_free_in_a_child_forked_while_a_thread_holds_them(installed: Path) -> None:
    """A thread holds the hooks' lock, the patch's lock and the class records' lock when another
    forks: the child, which has no such thread, can still take them all (it would wait forever
    otherwise), through the package's one fork handler."""
    result = run_python(f"""
        import os, signal, sys, threading
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import fsdp_autopatch
        import site_stand_in as module
        from fsdp_autopatch import _hooks, _patch, _sites
        fsdp_autopatch.register_fork_handler()  # as arm() does at start-up

        class Original:
            pass

        site = _sites.Site("stand-in API", module.__name__, "wrap", ("Wrapper",), "W", "deepcopy")
        _patch.install(_patch.resolve(site))
        held, release = threading.Event(), threading.Event()

        def hold():
            with _hooks._lock, _patch._lock, _patch.classes._lock:
                held.set()
                release.wait()

        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a deadlocked child dies of SIGALRM instead of hanging the test
            _hooks.current_status()
            built = module.wrap(Original())
            os._exit(0 if built.__bases__ == (module.Wrapper, Original) else 3)
        _, code = os.waitpid(pid, 0)
        release.set()
        print(os.waitstatus_to_exitcode(code))
    """, env=environment(FSDP_AUTOPATCH="0"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "0"


def test_hooks_register_when_stderr_is_none(installed: Path) -> None:
    """pythonw and some services run with ``sys.stderr = None``: a bad switch value cannot be
    printed, and the patch is armed all the same."""
    result = run_python(
        "import sys; sys.stderr = None\n" + IMPORT_BOTH, env=environment(FSDP_AUTOPATCH="yes please")
    )
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"{layout_bug_here()}\n"


def test_replicate_import_running_when_the_patch_is_armed_is_patched_when_it_ends(
    real_torch: dict[str, str]
) -> None:
    """``apply()`` (no start-up file) while another thread is inside replicate_with_fsdp's import:
    wrapt calls the hook at once, on the half-run module, and never again; the patch waits for
    that import to finish and then patches replicate()'s site, with no warning."""
    result = run_python(INTERCEPT_IMPORT + textwrap.dedent("""
        import importlib, json, threading, time
        import fsdp_autopatch
        fsdp_autopatch.disarm()  # as in an interpreter that read no start-up file
        import torch.distributed.fsdp, transformers
        NAME = "torch.distributed._composable.replicate_with_fsdp"
        entered, release = threading.Event(), threading.Event()
        # The worker's import stops before the module runs, until this thread releases it.
        intercept(NAME, before=lambda module: (entered.set(), release.wait()))
        worker = threading.Thread(target=importlib.import_module, args=(NAME,))
        worker.start()
        entered.wait()
        at_apply = fsdp_autopatch.apply().to_dict()
        release.set()
        worker.join()
        deadline = time.monotonic() + 30
        while len(fsdp_autopatch.status().sites) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        print(json.dumps({"at_apply": at_apply, "after": fsdp_autopatch.status().to_dict()}))
    """), env=environment(FSDP_AUTOPATCH_LOG="warning"))
    assert result.returncode == 0, result.stderr[-4000:]
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


# torch's fully_shard made to call a copy of its helper with globals of its own, as a torch that
# moved the helper would: the stand-in in the helper's module no longer reaches it.
CALLS_A_COPY = """
    import abc, json, types
    import torch.distributed.fsdp
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fully_shard

    helper = _fully_shard._apply_to_module
    _fully_shard._apply_to_module = types.FunctionType(helper.__code__, dict(helper.__globals__))

    import transformers
    import fsdp_autopatch
    from fsdp_autopatch import _verify

    class Head(abc.ABC, nn.Linear):
        pass

    try:
        fully_shard(Head(4, 4), mesh=_verify.init_process_group())
        error = None
    except TypeError as caught:
        error = str(caught)
    stand_in = helper.__globals__.get("_fsdp_autopatch_type")
    print(json.dumps({"status": fsdp_autopatch.status().to_dict(), "error": error,
                      "stand_in": [type(stand_in).__name__, len(getattr(stand_in, "constructions", ()))]}))
"""


def test_status_says_applied_only_after_the_fix_passed_its_self_check(real_torch: dict[str, str]) -> None:
    """A torch whose fully_shard does not reach the replaced ``type``: the self-check fails, the
    status says fully_shard runs unpatched and why, one warning, and the builtin is back where
    no other site needs the stand-in; composable DDP, which passes, stays patched."""
    result = run_python(CALLS_A_COPY, env=environment(FSDP_AUTOPATCH_LOG="warning"))
    assert result.returncode == 0, result.stderr[-4000:]
    (report,) = json_lines(result.stdout)
    assert_unpatched_torch(report)
    if not layout_bug_here():  # nothing to patch, so nothing to check
        assert report["status"]["applied"] is False and warnings_of(result.stderr) == []
        return
    status = report["status"]
    assert status["sites"] == [f"{DDP_MODULE}.replicate"] and report["stand_in"] == ["NoneType", 0]
    (warning,) = warnings_of(result.stderr)
    assert warning.startswith("fsdp-autopatch WARNING: FSDP2 fully_shard runs unpatched: the fix failed its "
                              "self-check: a throwaway ABC module still fails in torch's construction at "
                              f"{FULLY_SHARD_SITE}.fully_shard: ")
    assert warning.removeprefix("fsdp-autopatch WARNING: ") in status["reason"]
    # The same code with torch untouched passes the check.
    untouched = run_python(CALLS_A_COPY.replace(
        "_fully_shard._apply_to_module = types.FunctionType", "copy = types.FunctionType"))
    (report,) = json_lines(untouched.stdout)
    assert report["status"]["applied"] is True and report["error"] is None
    assert report["stand_in"] == ["TypeStandIn", 1]


NEWER_UNPROBED = """
    import json, sys
    import torch
    torch.__version__ = "2.99.0"  # newer than every row of the matrix
    import torch.distributed.fsdp
    from torch.distributed.fsdp._fully_shard import _fully_shard

    def unknown(modules, cls_to_wrapper_cls, wrapper_module_cls, wrapper_cls_prefix,
                unimplemented_deepcopy, placement):
        raise AssertionError("never called")

    helper, _fully_shard._apply_to_module = _fully_shard._apply_to_module, unknown
    import transformers
    _fully_shard._apply_to_module = helper
    import fsdp_autopatch
    print(json.dumps(fsdp_autopatch.status().to_dict()))
"""


def test_a_decision_that_cannot_tell_is_a_warning(real_torch: dict[str, str]) -> None:
    """A torch newer than the matrix whose construction cannot be probed: not patched, and the
    warning level (not only info) says so, since the heads may fail."""
    result = run_python(NEWER_UNPROBED, env=environment(FSDP_AUTOPATCH_LOG="warning"))
    assert result.returncode == 0, result.stderr[-4000:]
    (status,) = json_lines(result.stdout)
    assert status["applied"] is False and status["in_matrix"] is None
    assert "newer than the matrix" in status["reason"] and "could not be probed" in status["reason"]
    assert warnings_of(result.stderr) == [
        f"fsdp-autopatch WARNING: not patching (decided by the version matrix): {status['reason']}"]


def test_unknown_layout_names_transformers_when_it_is_imported(real_torch: dict[str, str]) -> None:
    code = """
        import json
        import transformers, torch.distributed.fsdp
        import fsdp_autopatch
        print(json.dumps(fsdp_autopatch.status().to_dict()))
    """
    moved = run_python(with_name_moved(FULLY_SHARD_SITE, "_unimplemented_deepcopy", code))
    assert moved.returncode == 0, moved.stderr[-4000:]
    (status,) = json_lines(moved.stdout)
    assert "FSDP2 layout is unknown" in status["reason"]
    assert status["transformers"] == real_torch["transformers"] and status["torch"] is not None


# python -S (no start-up file), apply() while another thread is in the middle of importing
# torch.distributed.fsdp: the hooks then see that import end.
APPLY_DURING_IMPORT = """
    import importlib, json, sys, threading, time
    sys.path[:0] = {path!r}
    import transformers
    worker = threading.Thread(target=importlib.import_module, args=("torch.distributed.fsdp",))
    worker.start()
    time.sleep({delay})
    import fsdp_autopatch
    fsdp_autopatch.apply()
    worker.join()
    deadline = time.monotonic() + 30
    while not fsdp_autopatch.status().applied and time.monotonic() < deadline:
        time.sleep(0.01)
    print(json.dumps(fsdp_autopatch.status().to_dict()))
"""


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.01])
def test_apply_while_another_thread_imports_fsdp2(installed: Path, delay: float) -> None:
    path = [str(installed), str(Path(fsdp_autopatch.__file__).parent.parent)]
    result = run_python(APPLY_DURING_IMPORT.format(path=path, delay=delay), "-S")
    assert result.returncode == 0, result.stderr[-4000:]
    (status,) = json_lines(result.stdout)
    assert status["applied"] is layout_bug_here(), status
    assert not status["reason"].startswith("waiting"), status
