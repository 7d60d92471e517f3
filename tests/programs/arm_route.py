"""A training process, armed by whichever route its interpreter has: the start-up file, or
torch's plugin entry point where no start-up file is read (``python -S``, ``PYTHONPATH``).

    python [-S] tests/programs/arm_route.py [--package-first | --torch-inside-package-import]

``--package-first``: ``import fsdp_autopatch`` before torch. ``--torch-inside-package-import``:
an import hook imports torch just before the package's own code runs, so that torch calls its
entry point while ``fsdp_autopatch`` is in ``sys.modules`` but still empty.

Then an ``abc.ABC``-first module is wrapped with FSDP2 ``fully_shard`` and with composable DDP
``replicate`` on a 1-rank gloo group. Prints one JSON object: the route that armed, the status,
and each wrapper's error (None where it wrapped).
"""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import json
import sys
from typing import Any, Optional


class TorchFirst(importlib.abc.MetaPathFinder):
    """Lends the package's import a loader that imports torch before the package's code runs."""

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if name != "fsdp_autopatch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = TorchFirstLoader(spec.loader)
        return spec


class TorchFirstLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        import torch  # noqa: F401 (torch calls its entry points now, the package still empty)

        self.loader.exec_module(module)


def main(argv: list[str]) -> int:
    if "--torch-inside-package-import" in argv:
        sys.meta_path.insert(0, TorchFirst())
    if "--package-first" in argv or "--torch-inside-package-import" in argv:
        import fsdp_autopatch
    import torch

    # What of the package's the route imported, before this program imports it below.
    ours = sorted(name for name in sys.modules
                  if name.split(".")[0] in ("fsdp_autopatch", "_fsdp_autopatch_plugin"))
    import transformers  # noqa: F401 (an affected release arms the patch in auto mode)
    from torch import nn
    from torch.distributed._composable.replicate import replicate

    import fsdp_autopatch
    from fsdp_autopatch import _verify

    fully_shard = _verify.fsdp2().fully_shard  # torch.distributed.fsdp's, or torch 2.4 - 2.5's

    class Head(abc.ABC, nn.Linear):
        pass

    mesh = _verify.init_process_group()
    errors: dict[str, Optional[str]] = {}
    for name, wrap in (("fully_shard", lambda m: fully_shard(m, mesh=mesh)), ("replicate", replicate)):
        try:
            wrap(Head(4, 4))
            errors[name] = None
        except TypeError as error:
            errors[name] = str(error)
    status = fsdp_autopatch.status()
    print(json.dumps({"armed_by": fsdp_autopatch.armed_by, "deferred": fsdp_autopatch.arm_when_imported,
                      "applied": status.applied, "sites": list(status.sites), "errors": errors,
                      "imported_by_import_torch": ours}))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
