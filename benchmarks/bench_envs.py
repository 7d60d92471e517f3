"""Throwaway virtual environments for the benchmarks, built from the checkout.

The package goes in as a wheel built from the checkout (``pip wheel --no-deps``), as users get
it: the ``.pth`` at the root of site-packages is what runs. Venvs are made ``--without-pip`` and
filled by the running interpreter's pip (``pip --python``): pip and setuptools would put their
own ``.pth`` files and modules into every start-up and blur the comparison.

Each venv records what it was built from (``bench-recipe.json``); a kept venv (``--venvs DIR``)
whose recipe still matches is reused and only gets the freshly built wheel reinstalled.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

# tests/harness.py, put on sys.path by run.py: one venv maker, and one set of pinned versions,
# for the tests and benchmarks.
from harness import make_venv, requirements, run_logged, venv_layout

RECIPE_FILE = "bench-recipe.json"

# The torch and transformers the tests run on: that transformers' heads inherit abc.ABC, so the
# patch is really installed in the benchmarks' processes.
TORCH_REQUIREMENTS = requirements("torch", "transformers")
# The naive design: a start-up file that imports wrapt and registers its hook straight away.
NAIVE_PTH_NAME = "naive_autopatch.pth"
NAIVE_PTH_LINE = (
    "import wrapt; wrapt.register_post_import_hook(lambda module: None, 'torch.distributed.fsdp')\n"
)
# The floor of every start-up file that imports a module: a one-line module imported by a .pth
# line, which pays the import system's search of site-packages and the reading of a file, as
# fsdp_autopatch does. Its import time, measured in the same alternation, is the machine's share.
ONE_LINE_MODULE = "one_line_module"
ONE_LINE_PTH_NAME = f"{ONE_LINE_MODULE}.pth"
ONE_LINE_PTH_LINE = f"import {ONE_LINE_MODULE}\n"


def log(message: str) -> None:
    print(f"[benchmarks] {message}", file=sys.stderr, flush=True)


def _pip_install(python: Path, *requirements: str, extra: tuple[str, ...] = ()) -> None:
    # --no-compile: byte-compiling all of torch and transformers takes longer than installing
    # them; the modules a benchmark imports get compiled in its warm-up runs instead.
    run_logged([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile",
                "--disable-pip-version-check", *extra, *requirements], None, timeout=3600)


def ensure_venv(
    venv: Path,
    requirements: tuple[str, ...],
    wheel: Optional[Path] = None,
    naive_pth: bool = False,
    one_line_pth: bool = False,
    base_python: str = sys.executable,
) -> Path:
    """A venv with ``requirements`` (and the package's ``wheel``, if given); returns its python."""
    recipe = {
        "base_python": str(Path(base_python).resolve()),
        "python_version": sys.version if base_python == sys.executable else None,
        "requirements": list(requirements),
        "package": wheel is not None,
        "naive_pth": naive_pth,
        "one_line_pth": one_line_pth,
    }
    recipe_path = venv / RECIPE_FILE
    python = venv_layout(venv).python
    fresh = not (recipe_path.is_file() and python.exists()
                 and json.loads(recipe_path.read_text()) == recipe)
    if fresh:
        if venv.exists():
            shutil.rmtree(venv)
        log(f"creating {venv} ({', '.join(requirements) or 'nothing'}"
            f"{' + fsdp-autopatch' if wheel else ''}{' + naive .pth' if naive_pth else ''})")
        make_venv(venv, base_python=base_python)
        if requirements:
            _pip_install(python, *requirements)
    if wheel is not None:
        # Always the wheel just built: a kept venv must measure the checkout as it is now.
        _pip_install(python, str(wheel), extra=("--no-deps", "--force-reinstall"))
    if naive_pth:
        (venv_layout(venv).site_packages / NAIVE_PTH_NAME).write_text(NAIVE_PTH_LINE)
    if one_line_pth:
        (venv_layout(venv).site_packages / f"{ONE_LINE_MODULE}.py").write_text("imported = True\n")
        (venv_layout(venv).site_packages / ONE_LINE_PTH_NAME).write_text(ONE_LINE_PTH_LINE)
    recipe_path.write_text(json.dumps(recipe, indent=1))
    return python


def has_torch_stack(python: str) -> bool:
    """Can ``python`` run the torch benchmarks: torch, transformers and the installed ``.pth``?"""
    code = (
        "import importlib.util as u, sys, sysconfig, os\n"
        "ok = all(u.find_spec(n) for n in ('torch', 'transformers', 'wrapt', 'fsdp_autopatch'))\n"
        "ok = ok and os.path.isfile(os.path.join(sysconfig.get_paths()['purelib'], 'fsdp_autopatch.pth'))\n"
        "sys.exit(0 if ok else 1)\n"
    )
    # Run from the filesystem root: from the checkout, "-c" would find its fsdp_autopatch.
    result = subprocess.run([python, "-c", code], capture_output=True, check=False, cwd=Path("/"))
    return result.returncode == 0
