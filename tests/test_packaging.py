"""What installing the distribution puts in an environment, and what it asks for."""

from __future__ import annotations

import subprocess
import venv
from importlib import metadata
from pathlib import Path

import pytest
from conftest import ROOT, environment, run_python

DISTRIBUTION = "fsdp-autopatch"


def test_only_wrapt_is_required(installed: Path) -> None:
    """torch and transformers are what the package patches: installing it must never pull them."""
    requirements = metadata.requires(DISTRIBUTION) or []
    assert [r for r in requirements if "extra ==" not in r] == ["wrapt>=1.14"]
    assert metadata.metadata(DISTRIBUTION)["Requires-Python"] == ">=3.9"


def test_start_up_files_sit_at_the_root_of_site_packages(installed: Path) -> None:
    files = {str(path) for path in metadata.files(DISTRIBUTION) or []}
    assert {"fsdp_autopatch.pth", "fsdp_autopatch.start", "fsdp_autopatch/__init__.py"} <= files
    entry_points = metadata.distribution(DISTRIBUTION).entry_points
    scripts = {ep.name: ep.value for ep in entry_points if ep.group == "console_scripts"}
    assert scripts == {"fsdp-autopatch": "fsdp_autopatch._cli:main"}


@pytest.mark.slow
def test_editable_install_arms_and_uninstalls_cleanly(tmp_path: Path) -> None:
    environment_dir = tmp_path / "editable"
    venv.create(environment_dir, with_pip=True)
    python = str(environment_dir / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "install", "-e", str(ROOT)], check=True, timeout=600, env=environment())
    purelib = run_python("import sysconfig; print(sysconfig.get_paths()['purelib'])", python=python)
    site = Path(purelib.stdout.strip())
    assert {"fsdp_autopatch.pth", "fsdp_autopatch.start"} <= {p.name for p in site.iterdir()}
    armed = run_python("import sys; print(type(sys.meta_path[0]).__name__)", python=python)
    assert (armed.stdout, armed.stderr) == ("FirstImportWatcher\n", "")

    subprocess.run([*pip, "uninstall", "--yes", DISTRIBUTION], check=True, timeout=600, env=environment())
    assert not [p.name for p in site.iterdir() if "fsdp" in p.name.lower()]
    after = run_python("import sys; print(sorted(m for m in sys.modules if 'fsdp' in m))", python=python)
    assert (after.stdout, after.stderr) == ("[]\n", "")
