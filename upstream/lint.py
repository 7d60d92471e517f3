"""Lints what upstream/torch.diff adds to torch with torch's own settings: ruff, ruff's formatter
and usort, on the files the patch touches and on its test, at the paths they have in torch.

    pip install $(python upstream/lint.py --requirements)
    python upstream/lint.py            # exit 0 clean, 1 a finding (printed), 2 it cannot run

The settings are pytorch's pyproject.toml ([tool.ruff], [tool.ruff.lint], [tool.usort]) as read
at pytorch/pytorch@0034f545bb95a408bd09c53db4b97cd7d02ba556, restated below (torch's file itself is
not kept here); ruff infers torch's target, Python 3.10, from its requires-python. The files torch
already has are taken from the installed torch with the patch applied (or as they are, where the
installed torch has the patch already), so that torch's import order is checked around the new
import.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH = ROOT / "upstream" / "torch.diff"
# Each file of the pull request, by its path in torch, and where this project keeps it (None: the
# installed torch's, patched).
FILES = {
    "torch/distributed/_wrapper_cls.py": ROOT / "fsdp_autopatch" / "_wrapper_cls.py",
    "test/distributed/_composable/test_wrapper_cls.py": ROOT / "upstream" / "test_wrapper_cls.py",
    "torch/distributed/_composable/replicate.py": None,
    "torch/distributed/fsdp/_fully_shard/_fsdp_init.py": None,
}
# The tools at the versions this was checked with.
REQUIREMENTS = ("ruff==0.17.6", "usort==1.1.3")

TORCH_SETTINGS = """\
[project]
name = "torch"
requires-python = ">=3.10"

[tool.usort]
preserve_inline_comments = true
collapse_blank_lines_in_category = false

[tool.usort.known]
first_party = ["caffe2", "torch", "torchgen", "functorch", "test"]
standard_library = ["typing_extensions"]

[tool.ruff]
line-length = 88
src = ["caffe2", "torch", "torchgen", "functorch", "test"]

[tool.ruff.format]
docstring-code-format = true
quote-style = "double"

[tool.ruff.lint]
ignore = [
    "B007", "B008", "B017", "B018", "B023", "B028", "E402", "C408", "E501", "E741", "EXE001",
    "F405", "FURB122", "NPY002", "PERF203", "PERF401", "PYI024", "PYI036", "PYI041", "PYI056",
    "SIM102", "SIM103", "SIM112", "SIM105", "SIM108", "SIM110", "SIM114", "SIM116", "SIM117",
    "SIM300", "TC006", "B905",
]
select = [
    "B", "B904", "C4", "G", "E", "EXE", "F", "SIM", "W", "FURB", "LOG", "NPY", "PERF", "PGH004",
    "PIE", "PLC0131", "PLC0132", "PLC1802", "PLC0205", "PLC3002", "PLC0414", "PLE", "PLR0133",
    "PLR0206", "PLR1722", "PLR1736", "PLW0127", "PLW0129", "PLW0131", "PLW0133", "PLW0245",
    "PLW0406", "PLW0711", "PLW1501", "PLW1507", "PLW1509", "PLW2101", "PLW3301", "PT006", "PT014",
    "PT022", "PT023", "PT024", "PT025", "PT026", "PYI", "Q003", "Q004", "RSE", "RUF007", "RUF008",
    "RUF013", "RUF015", "RUF016", "RUF017", "RUF018", "RUF019", "RUF020", "RUF024", "RUF026",
    "RUF030", "RUF033", "RUF041", "RUF048", "RUF100", "RUF200", "S324", "SLOT", "TC", "TRY002",
    "TRY203", "TRY401", "UP", "YTT", "S101",
]

[tool.ruff.lint.per-file-ignores]
"__init__.py" = ["F401"]
"""


def torch_files(tree: Path) -> None:
    """The installed torch's files that the patch changes, copied into ``tree`` and patched, with
    the patch's new files; a torch that has the patch already (``torch/distributed/_wrapper_cls.py``
    is there) gives its files as they are, once the patch is shown to be applied to them."""
    import torch

    installed = Path(torch.__file__).resolve().parent.parent
    for relative, own in FILES.items():
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(installed / relative if own is None else own, tree / relative)
    if (installed / "torch/distributed/_wrapper_cls.py").is_file():
        command = ["patch", "-p1", "--quiet", "--reverse", "--dry-run", "--input", str(PATCH)]
    else:
        for relative, own in FILES.items():
            if own is not None:
                (tree / relative).unlink()
        command = ["patch", "-p1", "--quiet", "--forward", "--input", str(PATCH)]
    subprocess.run(command, cwd=tree, check=True)


def main(argv: list[str]) -> int:
    if "--requirements" in argv:
        print(" ".join(REQUIREMENTS))
        return 0
    with tempfile.TemporaryDirectory(prefix="torch-lint-") as scratch:
        tree = Path(scratch)
        (tree / "pyproject.toml").write_text(TORCH_SETTINGS, encoding="utf-8")
        try:
            torch_files(tree)
        except (ImportError, OSError, subprocess.CalledProcessError) as error:
            print(f"upstream/lint.py: cannot put torch's files in place ({error}); install torch and patch",
                  file=sys.stderr)
            return 2
        ours = [relative for relative, own in FILES.items() if own is not None]
        commands = [
            [sys.executable, "-m", "ruff", "check", "--no-cache", *FILES],
            [sys.executable, "-m", "ruff", "format", "--no-cache", "--check", "--diff", *ours],
            [sys.executable, "-m", "usort", "check", *FILES],
        ]
        failed = 0
        for command in commands:
            result = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                failed = 1
                print(f"$ {' '.join(command[2:])}\n{result.stdout}{result.stderr}", end="")
        return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
