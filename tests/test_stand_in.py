"""tests/stand_in/, the stand-in torch that the tests of the package's own machinery import in
milliseconds, kept in step with the installed real torch: the package must recognise the same
site rows in both, and each shared helper must be torch's code, name for name.

Read from source files, compiled and not run (as doctor reads torch), so this costs no import of
torch. Where the installed torch is not the release the stand-in copies, it is skipped.
"""

from __future__ import annotations

import dis
from pathlib import Path
from typing import Any, Optional

import made_up_releases
import pytest
from conftest import STAND_IN, site_packages
from harness import TORCH_PIN

from fsdp_autopatch import _console, _doctor, _matrix, _sites

# The release whose modules the stand-in copies (tests/stand_in/README.md).
STAND_IN_RELEASE = (2, 13)


def module_path(root: Path, module: str) -> Optional[Path]:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def read_sites(root: Path) -> dict[str, Any]:
    """Per torch site row of the release the stand-in copies (by key): the compiled builder code
    where the tree under ``root`` (holding ``torch/``) has the row's shape, else what it lacks."""
    compiled: dict[str, _doctor.Compiled] = {}
    for site in _sites.SITES:
        for module in site.modules:
            path = module_path(root, module)
            if path is not None and module not in compiled:
                compiled[module] = _doctor.compile_module(path, module)
    has, code_of, origin = _doctor.file_lookups(compiled)
    found = {}
    # Another distribution's rows, and a newer release's, are not the installed torch's to match.
    for site in _sites.SITES:
        if _sites.distribution_of(site.api) != "torch" or site.since > STAND_IN_RELEASE:
            continue
        problem = _sites.shape_problem(site, has, code_of, origin)
        found[site.key] = problem or code_of(site.builder_module, site.builder)[0]
    return found


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_the_stand_in_has_every_module_start_up_watches(
    release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/test_startup.py imports each on the stand-in, and doctor's tests build a torch of every
    site from it: a module a new release adds to TORCH_MODULES goes there too (CONTRIBUTING; a
    made-up release's, in its folder of tests/stand_in/made_up/)."""
    made_up_releases.add_rows(release, monkeypatch.setattr)
    made_up = made_up_releases.releases_up_to(release) if release else []
    roots = [STAND_IN, *(made_up_releases.MADE_UP / each.torch for each in made_up)]
    assert [name for name in _sites.TORCH_MODULES if not any(module_path(root, name) for root in roots)] == []


def test_the_stand_in_copies_the_release_the_tests_pin() -> None:
    """A release the tests do not pin gets nothing in the stand-in; when the pin moves to one, the
    stand-in's modules become that release's (CONTRIBUTING), and this release with them."""
    assert STAND_IN_RELEASE == _matrix.release(TORCH_PIN)[:2]


def signature(code: Any) -> tuple[Any, ...]:
    """What the patch reads of a builder: its parameters, the names it uses, the globals it loads."""
    globals_loaded = [op.argval for op in dis.get_instructions(code) if op.opname == "LOAD_GLOBAL"]
    return code.co_varnames[: code.co_argcount], code.co_names, globals_loaded


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_the_stand_in_has_the_sites_of_the_installed_torch(
    release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    made_up_releases.add_rows(release, monkeypatch.setattr)
    torch_dir = site_packages() / "torch"
    version = _console.installed_version("torch")
    if version is None or not (torch_dir / "__init__.py").is_file():
        pytest.skip("torch is not installed here; run the tests with: nox -f tests/noxfile.py -s tests")
    if _matrix.release(version)[:2] != STAND_IN_RELEASE:
        pytest.skip(f"the stand-in copies torch {'.'.join(map(str, STAND_IN_RELEASE))}; torch {version} is "
                    "installed")
    real, stand_in = read_sites(torch_dir.parent), read_sites(STAND_IN)
    recognised = sorted(name for name, found in real.items() if not isinstance(found, str))
    assert recognised, "the installed torch has none of the site rows"
    assert sorted(name for name, found in stand_in.items() if not isinstance(found, str)) == recognised
    # Rows that do not match say why, in the same words.
    assert {name: found for name, found in stand_in.items() if isinstance(found, str)} == {
        name: found for name, found in real.items() if isinstance(found, str)}
    # A helper in a module of its own is torch's code: the same parameters, names and globals.
    for site in _sites.SITES:
        if site.key in recognised and site.builder_module != site.module:
            assert signature(stand_in[site.key]) == signature(real[site.key]), site
