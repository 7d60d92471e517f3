"""upstream/torch.diff, the fix torch needs with its test, applied to a copy of the installed torch:
proven on real torch and transformers, beside the same runs on the unpatched torch (CI's tier).

The copy lives in a throwaway directory put ahead of site-packages on ``PYTHONPATH``: every file
is a hard link to the installed torch's but the three the patch changes, which are copied first,
so the installed torch is never touched. With ``FSDP_AUTOPATCH=0``, the affected heads and a
user's ``Generic[T]``-first module wrap and train through fully_shard, FSDP2's replicate and
composable DDP, and every other module gets exactly the class unpatched torch builds. With the
package on, it finds nothing to fix: it rewrites nothing, prints nothing, and doctor and verify
say so. upstream/test_wrapper_cls.py, written as one of torch's own distributed tests,
passes on the copy and fails on the installed torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import util
from pathlib import Path
from typing import Any

import pytest
from conftest import LAYOUT_ERROR, ROOT, environment, json_lines, layout_bug_here, own_lines
from harness import torchrun

from fsdp_autopatch import _sites, _verify

pytestmark = [pytest.mark.slow, pytest.mark.ci_tier]

UPSTREAM = ROOT / "upstream"
PATCH = UPSTREAM / "torch.diff"
TORCH_STYLE_TEST = UPSTREAM / "test_wrapper_cls.py"
RUN = ROOT / "tests" / "programs" / "upstream_run.py"
# The models whose class needs the fix; every other one must get torch's own class.
NEEDS_THE_FIX = ("token-classification", "sequence-classification", "question-answering", "generic-first")
APIS = (_sites.FULLY_SHARD, _sites.FSDP2_REPLICATE, _sites.DDP_REPLICATE)


def patched_files() -> list[str]:
    """The files the patch changes, relative to the directory that holds ``torch/``."""
    return re.findall(r"^\+\+\+ b/(\S+)", PATCH.read_text(encoding="utf-8"), re.MULTILINE)


@pytest.fixture(scope="module")
def patched_torch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a copy of the installed torch with the patch applied (which adds one
    file, torch/distributed/_wrapper_cls.py)."""
    spec = util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations, "torch is not installed"
    installed = Path(next(iter(spec.submodule_search_locations)))
    root = tmp_path_factory.mktemp("patched torch")
    shutil.copytree(installed, root / "torch", copy_function=os.link)
    for relative in patched_files():
        if (root / relative).exists():  # a file torch has: a copy of its own, not a link
            (root / relative).unlink()
            shutil.copy2(installed.parent / relative, root / relative)
    if shutil.which("patch"):
        command = ["patch", "-p1", "--forward", "--input", str(PATCH)]
    else:  # the same unified diff, where GNU patch is not installed
        command = ["git", "apply", "-p1", str(PATCH)]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}"
    return root


def with_torch(root: Path | None, **env: str) -> dict[str, str]:
    """The tests' environment, with the torch under ``root`` ahead of the installed one."""
    variables = environment(**env)
    if root is not None:
        variables["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), variables.get("PYTHONPATH"))))
    return variables


def run(arguments: list[str], root: Path | None, **env: str) -> subprocess.CompletedProcess[str]:
    """``python *arguments`` with the torch under ``root`` (None: the installed one)."""
    return subprocess.run([sys.executable, *arguments], capture_output=True, text=True,
                          env=with_torch(root, **env), cwd=ROOT, timeout=600, check=False)


Results = dict[tuple[str, str], Any]  # by (API, model)


def wrap_everything(root: Path | None, **env: str) -> tuple[list[dict[str, Any]], Results, str]:
    """Rank 0's status lines, its results by (API, model), and both ranks' stderr."""
    result = torchrun(RUN, env=with_torch(root, **env), cwd=ROOT, timeout=900)
    lines = json_lines(result.stdout)
    results = {(line["api"], line["model"]): line for line in lines if "api" in line}
    return [line for line in lines if "status" in line], results, result.stderr


@pytest.fixture(scope="module")
def patched_off(patched_torch: Path) -> Results:
    statuses, results, _ = wrap_everything(patched_torch, FSDP_AUTOPATCH="0")
    assert all(not status["status"]["applied"] for status in statuses)
    return results


# Where the patch puts the test it adds, in torch's tree.
TEST_IN_TORCH = "test/distributed/_composable/test_wrapper_cls.py"


def test_the_patch_changes_torch_files_and_adds_its_test() -> None:
    files = patched_files()
    assert TEST_IN_TORCH in files
    assert all(path.startswith("torch/") for path in files if path != TEST_IN_TORCH)
    assert all(line[len("--- a/"):] in files for line in PATCH.read_text(encoding="utf-8").splitlines()
               if line.startswith("--- "))


def test_the_description_is_a_two_minute_read() -> None:
    """upstream/README.md is the pull request's description: at most 60 lines, the issue it fixes,
    and a test plan that names every file run and the lint run."""
    text = (UPSTREAM / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 60
    assert "Fixes #160068." in text and "## Test plan" in text and "upstream/lint.py" in text
    assert TORCH_STYLE_TEST.name in text.split("## Test plan")[1]


def test_torch_style_test_passes_on_the_patched_torch_and_fails_without(patched_torch: Path) -> None:
    pytest.importorskip(
        "expecttest", reason="expecttest is not installed (torch's tests need it); nox's tests session has it"
    )
    # torch's run_tests writes an XML report through xmlrunner whenever CI is set to anything
    # (torch/testing/_internal/common_utils.py, IS_CI): run it as a contributor would.
    patched = run([str(TORCH_STYLE_TEST)], patched_torch, FSDP_AUTOPATCH="0", CI="")
    assert patched.returncode == 0, patched.stderr[-4000:]
    assert re.search(r"^Ran 10 tests", patched.stderr, re.MULTILINE)
    unpatched = run([str(TORCH_STYLE_TEST)], None, FSDP_AUTOPATCH="0", CI="")
    if layout_bug_here():
        assert unpatched.returncode != 0 and LAYOUT_ERROR in unpatched.stderr
    else:  # CPython 3.15+: ABC-first passes without the fix; Generic-first is refused everywhere
        assert LAYOUT_ERROR in unpatched.stderr


def test_the_patched_torch_wraps_and_trains_every_module(patched_off: Results) -> None:
    for api in APIS:
        for model in (*_verify.MODELS, "generic-first", "abc-last", "plain"):
            result = patched_off[api, model]
            assert result["wrapped"], (api, model, result.get("error"))
            assert result["original_at_its_index"], (api, model)
            assert result["max_loss_difference"] < _verify.LOSS_TOLERANCE, (api, model)


def test_other_modules_get_the_classes_unpatched_torch_builds(patched_off: Results) -> None:
    _, unpatched, _ = wrap_everything(None, FSDP_AUTOPATCH="0")
    for (api, model), result in unpatched.items():
        if model in NEEDS_THE_FIX:
            # The control: without the patch, torch refuses them (Generic-first on every CPython).
            if layout_bug_here() or model == "generic-first":
                assert not result["wrapped"] and LAYOUT_ERROR in result["error"], (api, model)
        else:
            assert result["wrapped"], (api, model, result.get("error"))
            # Exactly the class unpatched torch builds, __module__ included.
            assert patched_off[api, model]["class"] == result["class"], (api, model)


def test_the_package_stands_aside_for_the_patched_torch(
    patched_torch: Path, patched_off: Results
) -> None:
    statuses, results, stderr = wrap_everything(patched_torch)
    for line in statuses:
        status = line["status"]
        assert status["applied"] is False and status["armed_by"], status
        assert "builds wrapper classes" in status["reason"] and "itself" in status["reason"], status["reason"]
        assert status["classes"] == []
        assert line["builders_untouched"]
    assert own_lines(stderr) == []
    # Exactly what torch does with the package off.
    assert {key: (result["wrapped"], result.get("class")) for key, result in results.items()} == {
        key: (result["wrapped"], result.get("class")) for key, result in patched_off.items()}


def test_a_torch_with_the_fix_says_nothing_without_wrapt(patched_torch: Path, tmp_path: Path) -> None:
    """wrapt missing, where torch builds accepted classes itself: every wrap succeeds, and the
    package says nothing (torch was asked, not the version rows)."""
    (tmp_path / "wrapt.py").write_text('raise ModuleNotFoundError("No module named wrapt", name="wrapt")\n')
    statuses, results, stderr = wrap_everything(patched_torch, PYTHONPATH=str(tmp_path))
    assert own_lines(stderr) == [], stderr[-3000:]
    assert all(result["wrapped"] for result in results.values())
    assert all(line["status"]["reason"].startswith("wrapt is not installed") for line in statuses)


def test_torchs_lint_settings_pass_on_a_torch_that_has_the_patch(patched_torch: Path) -> None:
    """upstream/lint.py answers where the installed torch has the patch already."""
    for tool in ("ruff", "usort"):
        pytest.importorskip(tool, reason=f"{tool} is not installed: pip install $(python upstream/lint.py "
                                         "--requirements); .ci/run installs them")
    result = run([str(UPSTREAM / "lint.py")], patched_torch)
    assert result.returncode == 0, result.stdout + result.stderr


def test_doctor_and_verify_say_nothing_needs_fixing(patched_torch: Path) -> None:
    doctor = run(["-m", "fsdp_autopatch", "doctor"], patched_torch)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "torch's files have the fix" in doctor.stdout
    verify = run(["-m", "fsdp_autopatch", "verify"], patched_torch)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "no patch was needed" in verify.stdout and "builds wrapper classes" in verify.stdout
