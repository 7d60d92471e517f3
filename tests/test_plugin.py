"""torch's plugin route: armed in every interpreter that imports torch, ``.pth`` read or not, and
never a cause of a failed ``import torch``.

The real-torch tests run tests/programs/arm_route.py with ``python -S`` (no start-up file is read) in two
layouts: the package installed by ``pip install --target`` and put on ``PYTHONPATH`` beside the
environment's torch, and the environment's own installation with its start-up files unread. The
fault tests use a fake torch whose import ends as torch 2.5+'s does, calling every entry point of
the group ``torch.backends``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    PLUGIN_MODULE,
    PROGRAMS,
    environment,
    fake_torch,
    fake_transformers,
    json_lines,
    layout_bug_here,
    lent_site_packages,
    make_throwaway,
    own_lines,
    pip_in,
    run_program,
)

import fsdp_autopatch
from fsdp_autopatch import _config, _matrix

PROGRAM = PROGRAMS / "arm_route.py"
PLUGIN_ROUTE = fsdp_autopatch.PLUGIN_ROUTE
# With the patch on, each wrapper wraps the ABC head (None); unpatched, CPython refuses it.
WRAPPED = {"fully_shard": None, "replicate": None}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory, installed: Path, package_wheel: Path) -> dict[str, str]:
    """PYTHONPATH for each layout that reads no start-up file (run under ``python -S``)."""
    root = tmp_path_factory.mktemp("plugin")
    target = root / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--target", str(target), str(package_wheel)], check=True, env=environment(),
                   capture_output=True, timeout=600)
    lent = lent_site_packages(root / "lent")
    return {
        # the package alone in a --target directory; torch and the rest from the environment
        "target": os.pathsep.join((str(target), str(lent))),
        # the environment's own installation, whose .pth and .start python -S never reads
        "no start-up file": str(installed),
    }


def arm_route(path: str, *args: str, **env: str) -> dict[str, Any]:
    result = run_program(PROGRAM, *args, flags=("-S",), env=environment(PYTHONPATH=path, **env))
    assert own_lines(result.stderr) == []
    (report,) = json_lines(result.stdout)
    return report


def assert_unpatched(report: dict[str, Any]) -> None:
    assert report["armed_by"] is None and report["applied"] is False
    for error in report["errors"].values():
        assert (error is not None and "object layout differs" in error) is layout_bug_here()


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "order"), [
    ("target", ""),
    # The same route in other layouts and orders: CI's tier.
    *(pytest.param(*case, marks=pytest.mark.ci_tier) for case in (
        ("target", "--package-first"), ("target", "--torch-inside-package-import"),
        ("no start-up file", ""))),
])
def test_armed_by_torchs_plugin_route_where_no_start_up_file_is_read(
    layouts: dict[str, str], layout: str, order: str
) -> None:
    report = arm_route(layouts[layout], *filter(None, [order]))
    assert report["armed_by"] == PLUGIN_ROUTE and report["errors"] == WRAPPED
    assert report["applied"] is layout_bug_here()
    # torch ran the entry point before the package's code had run: it armed when that ended.
    assert report["deferred"] is (order == "--torch-inside-package-import")


@pytest.mark.slow
@pytest.mark.parametrize("switch", [
    pytest.param({"FSDP_AUTOPATCH": "0"}, id="FSDP_AUTOPATCH=0"),
    # torch's own switch: CI's tier.
    pytest.param({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, id="TORCH_DEVICE_BACKEND_AUTOLOAD=0",
                 marks=pytest.mark.ci_tier),
])
def test_either_switch_keeps_the_plugin_route_from_arming(
    layouts: dict[str, str], switch: dict[str, str]
) -> None:
    """The package's switch works there as under the .pth, and imports nothing of the package:
    the entry point's module reads it first. torch's switch turns its whole group off."""
    report = arm_route(layouts["target"], **switch)
    assert_unpatched(report)
    expected = ["_fsdp_autopatch_plugin"] if "FSDP_AUTOPATCH" in switch else []
    assert report["imported_by_import_torch"] == expected


TORCH_ALONE = PROGRAMS / "torch_alone_imports.py"


@pytest.mark.slow
@pytest.mark.ci_tier
def test_both_routes_arm_once_and_torch_alone_loads_nothing_more(
    layouts: dict[str, str], real_torch: dict[str, str]
) -> None:
    """Where the start-up file ran, the plugin route finds the package armed; a process that
    imports torch alone loads the start-up module and the plugin's module, no wrapt, no hooks."""
    routes = (((), None, fsdp_autopatch.START_FILE_ROUTE), (("-S",), layouts["target"], PLUGIN_ROUTE))
    for flags, path, route in routes:
        result = run_program(TORCH_ALONE, flags=flags, env=environment(PYTHONPATH=path))
        (report,) = json_lines(result.stdout)
        assert report == {"ours": ["_fsdp_autopatch_plugin", "fsdp_autopatch"], "wrapt": False,
                          "armed_by": route}


# --- faults: import torch never fails because of the plugin route ---------------------------


TORCH_THEN_FSDP2 = """
import json, sys
import torch
import torch.distributed.fsdp
import fsdp_autopatch
print(json.dumps({"armed_by": getattr(fsdp_autopatch, "armed_by", None)}))
"""


def throwaway_with_plugins(tmp_path: Path, installed: Path, **parts: bool) -> Any:
    """A throwaway venv without start-up files, holding a fake torch that calls its plugins."""
    env = make_throwaway(tmp_path / "venv", installed, pth=False, **parts)
    fake_torch(env.site_packages, plugins=True)
    fake_transformers(env.site_packages)
    return env


def assert_import_torch_works(result: subprocess.CompletedProcess[str], max_lines: int = 0) -> None:
    assert result.returncode == 0, result.stderr[-4000:]
    assert len([line for line in result.stderr.splitlines() if line.strip()]) <= max_lines, result.stderr


def test_a_fake_torch_arms_through_its_plugins(tmp_path: Path, installed: Path) -> None:
    """The control for the faults below: with nothing broken, the plugin route arms."""
    env = throwaway_with_plugins(tmp_path, installed)
    result = env.run(TORCH_THEN_FSDP2)
    assert_import_torch_works(result)
    assert json.loads(result.stdout) == {"armed_by": PLUGIN_ROUTE}


@pytest.mark.parametrize("fault", ["package raises", "package removed", "wrapt missing", "junk switch"])
def test_import_torch_survives_every_fault_of_the_plugin_route(
    tmp_path: Path, installed: Path, fault: str
) -> None:
    env = throwaway_with_plugins(tmp_path, installed, package=fault != "package removed",
                                 wrapt=fault != "wrapt missing")
    if fault == "package raises":
        init = env.site_packages / "fsdp_autopatch" / "__init__.py"
        init.write_text('raise ImportError("a broken install")\n' + init.read_text())
        shutil.rmtree(env.site_packages / "fsdp_autopatch" / "__pycache__", ignore_errors=True)
    variables = {"FSDP_AUTOPATCH": "yes please"} if fault == "junk switch" else {}
    code = "import torch, torch.distributed.fsdp; print('ok')"
    result = env.run(code, **variables)
    # At most one line (at the FSDP2 import, not at torch's): the switch ignored. Without wrapt,
    # nothing yet: no affected transformers is imported, so the patch would not be installed.
    said = fault == "junk switch"
    assert_import_torch_works(result, max_lines=1 if said else 0)
    assert result.stdout == "ok\n"
    if fault == "junk switch":
        (line,) = own_lines(result.stderr)
        assert line.startswith("fsdp-autopatch: ignoring FSDP_AUTOPATCH=")
    if fault == "wrapt missing":
        assert own_lines(result.stderr) == []
        # With transformers too, where the stand-in pair has the bug: why it cannot be fixed.
        result = env.run("import torch, torch.distributed.fsdp, transformers; print('ok')")
        assert_import_torch_works(result, max_lines=1)
        bug = _matrix.decide(_config.AUTO, "2.13.0", "4.55.2").apply  # the stand-in pair, on this Python
        remedy = pip_in(env.python, "install wrapt")
        assert own_lines(result.stderr) == ["fsdp-autopatch: cannot fix the layout bug for ABC modules here: "
                                            f"wrapt is not installed ({remedy})"][:bug]


def test_a_plugin_module_left_without_its_package_keeps_import_torch_working(
    tmp_path: Path, installed: Path
) -> None:
    """Half removed by hand: the dist-info (with the entry point) and the plugin's module left."""
    env = throwaway_with_plugins(tmp_path, installed, package=False)
    (dist_info,) = installed.glob("fsdp_autopatch-*.dist-info")
    shutil.copytree(dist_info, env.site_packages / dist_info.name)
    assert (env.site_packages / PLUGIN_MODULE).is_file()
    assert_import_torch_works(env.run("import torch"))
