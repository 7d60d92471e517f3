"""Writes upstream/torch.diff from the package: the one fix, shipped twice from one source.

    python upstream/make_diff.py            # rewrite torch.diff from torch's files and the package
    python upstream/make_diff.py --check    # exit 1 if torch.diff is not what this would write

The patch adds fsdp_autopatch/_wrapper_cls.py to torch as torch/distributed/_wrapper_cls.py,
character for character, has FSDP2's builder and composable DDP's replicate call its
make_wrapper_cls in place of type, and adds its test, upstream/test_wrapper_cls.py, as
test/distributed/_composable/test_wrapper_cls.py. The two call sites' hunks are written from the lines below,
which are torch's own in 2.13.0 - 2.15.0 (tests/test_upstream.py applies the patch to the
installed torch; .ci/sid-pythons to 2.15.0).
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH = ROOT / "upstream" / "torch.diff"
PACKAGE_MODULE = ROOT / "fsdp_autopatch" / "_wrapper_cls.py"
TORCH_MODULE = "torch/distributed/_wrapper_cls.py"
# The new files, by their path in torch's tree: the module and its test.
NEW_FILES = {
    TORCH_MODULE: PACKAGE_MODULE,
    "test/distributed/_composable/test_wrapper_cls.py": ROOT / "upstream" / "test_wrapper_cls.py",
}
IMPORT = "from torch.distributed._wrapper_cls import make_wrapper_cls\n"



def hunk(before: str, old: str, new: str, after: str) -> tuple[str, str]:
    """One change, ``old`` lines to ``new`` ones, between three lines of torch's on each side."""
    return before + old + after, before + new + after


# Per file of torch's, its changes: the import, then ``type`` replaced where the class is built.
CALL_SITES = {
    "torch/distributed/_composable/replicate.py": [
        hunk(
            "import torch\n"
            "import torch.nn as nn\n"
            "from torch.distributed._composable_state import _State\n",
            "",
            IMPORT,
            "from torch.nn.parallel import DistributedDataParallel\n"
            "\n"
            "from .contract import _get_registry, contract\n",
        ),
        hunk(
            "    # Place DDP leftmost for highest priority in the method resolution order\n"
            "    cls = module.__class__\n"
            '    dct = {"__deepcopy__": unimplemented_deepcopy}\n',
            '    new_cls = type(f"DDP{cls.__name__}", (DDP, cls), dct)\n',
            '    new_cls = make_wrapper_cls(f"DDP{cls.__name__}", (DDP, cls), dct)\n',
            "    module.__class__ = new_cls\n"
            "    return module\n"
            "\n",
        ),
    ],
    "torch/distributed/fsdp/_fully_shard/_fsdp_init.py": [
        hunk(
            "import torch.distributed as dist\n"
            "import torch.nn as nn\n"
            "from torch._logging import warning_once\n",
            "",
            IMPORT,
            "from torch.distributed.device_mesh import _get_device_handle\n"
            "from torch.distributed.tensor import DeviceMesh, DTensor, init_device_mesh\n"
            "from torch.utils._python_dispatch import is_traceable_wrapper_subclass\n",
        ),
        hunk(
            "        new_cls = cls_to_wrapper_cls.get(cls)\n"
            "        if not new_cls:\n"
            '            dct = {"__deepcopy__": unimplemented_deepcopy}\n',
            "            new_cls = type(\n",
            "            new_cls = make_wrapper_cls(\n",
            '                f"{wrapper_cls_prefix}{cls.__name__}", (wrapper_module_cls, cls), dct\n'
            "            )\n"
            "            cls_to_wrapper_cls[cls] = new_cls\n",
        ),
    ],
}


def file_diff(path: str, hunks: list[tuple[str, str]], starts: list[int]) -> str:
    """``diff -ruN`` of one file: a hunk per (before, after), at the line of torch's file where
    ``before`` starts (a new file: one hunk, from nothing)."""
    out = [f"diff -ruN a/{path} b/{path}\n", f"--- a/{path}\n", f"+++ b/{path}\n"]
    shift = 0
    for (before, after), start in zip(hunks, starts):
        old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
        new_start = start + shift if old else 1
        out.append(f"@@ -{start},{len(old)} +{new_start},{len(new)} @@\n")
        for line in difflib.ndiff(old, new):
            if not line.startswith("? "):
                out.append((" " if line[0] == " " else line[0]) + line[2:])
        shift += len(new) - len(old)
    return "".join(out)


def torch_line(path: str, text: str) -> int:
    """The line of the installed torch's file where ``text`` starts."""
    import torch

    source = (Path(torch.__file__).parent.parent / path).read_text(encoding="utf-8")
    index = source.find(text)
    if index < 0:
        raise SystemExit(f"{path} of the installed torch lacks the lines upstream/make_diff.py changes")
    return source.count("\n", 0, index) + 1


def patch_text(starts: dict[str, list[int]]) -> str:
    """The whole patch, its files in ``diff -r``'s order."""
    files = {path: file_diff(path, hunks, starts[path]) for path, hunks in CALL_SITES.items()}
    for path, source in NEW_FILES.items():
        files[path] = file_diff(path, [("", source.read_text(encoding="utf-8"))], [0])
    return "".join(files[path] for path in sorted(files))


def recorded_starts() -> dict[str, list[int]]:
    """The hunks' lines as torch.diff has them now (written from torch v2.15.0's files)."""
    starts: dict[str, list[int]] = {}
    current = None
    for line in PATCH.read_text(encoding="utf-8").splitlines():
        if line.startswith("+++ b/"):
            current = line[len("+++ b/"):]
        elif line.startswith("@@ ") and current in CALL_SITES:
            starts.setdefault(current, []).append(int(line.split()[1][1:].split(",")[0]))
    return starts


def main(argv: list[str]) -> int:
    if PATCH.exists():
        starts = recorded_starts()
    else:
        starts = {path: [torch_line(path, before) for before, _ in hunks]
                  for path, hunks in CALL_SITES.items()}
    text = patch_text(starts)
    if "--check" in argv:
        if PATCH.read_text(encoding="utf-8") != text:
            print("upstream/torch.diff is not what upstream/make_diff.py writes from "
                  "fsdp_autopatch/_wrapper_cls.py and upstream/test_wrapper_cls.py: run python "
                  "upstream/make_diff.py", file=sys.stderr)
            return 1
        return 0
    PATCH.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
