"""doctor run on a source tree: it says so, and what to do, instead of judging an installation.

``python -m fsdp_autopatch doctor`` run from a checkout's root imports the checkout's sources
(``-m`` puts the working directory first on ``sys.path``), whether or not the package is also
installed; nothing they say describes what training processes of that Python load at start-up.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, environment, make_throwaway, pip_in
from test_cli import one_object

from fsdp_autopatch import _doctor


def checkout_copy(where: Path) -> Path:
    """What a clone of the project holds that doctor can see: the package, the start-up files
    and pyproject.toml."""
    where.mkdir(parents=True)
    shutil.copytree(ROOT / "fsdp_autopatch", where / "fsdp_autopatch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "fsdp_autopatch.pth", "fsdp_autopatch.start"):
        shutil.copy2(ROOT / name, where / name)
    return where


def doctor_in(python: Path, cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "fsdp_autopatch", "doctor", *args], capture_output=True,
                          text=True, cwd=cwd, env=environment(**env), timeout=120, check=False)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkout_copy(tmp_path_factory.mktemp("clone") / "fsdp-autopatch")


def test_doctor_on_a_source_tree_without_an_installation_cannot_tell_and_says_to_install(
    installed: Path, tmp_path: Path, checkout: Path
) -> None:
    # No torch either: an installation would get "OK: nothing to fix".
    python = make_throwaway(tmp_path / "venv", installed, package=False, pth=False).python
    shown = doctor_in(python, checkout)
    assert shown.returncode == 2, shown.stderr  # the exit code is the verdict
    detail = (f"{checkout} is a source tree, and fsdp-autopatch is not installed for {python} "
              f"({pip_in(python, 'install .')} there; doctor answers from any other directory)")
    assert shown.stdout.splitlines()[-1] == f"CANNOT TELL: {detail}"
    assert f"   ??  {detail}" in shown.stdout.splitlines()
    report = one_object(doctor_in(python, checkout, "--json").stdout)
    assert (report["installation"], report["installation_detail"], report["outcome"]) == (
        "source tree", detail, "CANNOT TELL")
    assert report["exit_code"] == 2
    # The checkout's own copy of the start-up file is not an installed one.
    assert report["pth_installed"] is None and report["startup_read"] is False


def test_doctor_from_a_checkout_beside_an_installation_says_which_it_is_reading(
    installed: Path, tmp_path: Path, checkout: Path
) -> None:
    throwaway = make_throwaway(tmp_path / "venv", installed)
    # The start-up file imports the installed package before -m puts the checkout on sys.path...
    armed = one_object(doctor_in(throwaway.python, checkout, "--json").stdout)
    assert armed["installation"] == "installed"
    assert armed["installation_detail"] == f"installed in {throwaway.site_packages}"
    # ...unless the switch is off, which skips that import: then the checkout's sources are read.
    shown = doctor_in(throwaway.python, checkout, FSDP_AUTOPATCH="0")
    if sys.version_info >= (3, 15):
        # PEP 829: the .start entry point imports the installed package even when switched off.
        off = one_object(doctor_in(throwaway.python, checkout, "--json", FSDP_AUTOPATCH="0").stdout)
        assert off["installation"] == "installed", off
        return
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert shown.stdout.splitlines()[-1] == (
        f"CANNOT TELL: {checkout} is a source tree, not the installed fsdp-autopatch "
        f"{throwaway.site_packages / 'fsdp_autopatch'} (run from another directory)")
    # From anywhere else, the same Python reads its installation.
    elsewhere = one_object(doctor_in(throwaway.python, tmp_path, "--json").stdout)
    assert elsewhere["installation"] == "installed"


@pytest.mark.parametrize("command", ["doctor", "verify"])
def test_python_s_in_a_checkout_names_the_site_packages_it_hides(
    installed: Path, checkout: Path, command: str
) -> None:
    """``python -S -m fsdp_autopatch`` in a checkout imports the checkout's sources, and -S hides
    the site-packages that hold the installation: what to set, and exit 2 (0.2.0 said the
    package was not installed)."""
    result = subprocess.run([sys.executable, "-S", "-m", "fsdp_autopatch", command], capture_output=True,
                            text=True, cwd=checkout, env=environment(), timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    setting = f"PYTHONPATH={shlex.quote(str(installed))}"  # as a user pastes it into a shell
    detail = (f"{checkout} is a source tree, and python -S hides {installed}, where fsdp-autopatch is "
              f"installed: set {setting}, as for a python -S training script, and run from "
              "another directory")
    verdict = {"doctor": "CANNOT TELL", "verify": "cannot verify"}[command]
    assert result.stdout.splitlines()[-1] == f"{verdict}: {detail}"


def test_an_editable_install_is_an_installation(tmp_path: Path) -> None:
    # pip install -e: the distribution points at the checkout, whose sources are the installed ones.
    checkout = checkout_copy(tmp_path / "clone")
    site_packages = tmp_path / "site_packages"
    dist_info = site_packages / "fsdp_autopatch-0.2.0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fsdp-autopatch\nVersion: 0.2.0\n")
    (dist_info / "direct_url.json").write_text(
        f'{{"dir_info": {{"editable": true}}, "url": "{checkout.as_uri()}"}}')
    from importlib import metadata

    (distribution,) = metadata.distributions(name="fsdp-autopatch", path=[str(site_packages)])
    assert _doctor.editable_directory(distribution) == checkout
    assert _doctor.is_source_tree(checkout) and not _doctor.is_source_tree(site_packages)
