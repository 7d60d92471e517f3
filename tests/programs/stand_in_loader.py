"""A stand-in finder for FSDP2 whose spec has a loader of the given kind, ahead of the fake on
disk, for tests/test_faults.py: where the package arms, and whether the global import lock was
held then. One JSON line.

    python tests/programs/stand_in_loader.py legacy|"read-only spec"
"""

import _imp
import importlib.machinery
import json
import sys
import types
import warnings

import fsdp_autopatch

KIND = sys.argv[1]

warnings.simplefilter("ignore", ImportWarning)  # 3.10+: the load_module() fallback
NAME = "torch.distributed.fsdp"
held = []
register_hooks = fsdp_autopatch.register_hooks


def spy():
    held.append(_imp.lock_held())  # the global import lock, held while finders run
    register_hooks()


fsdp_autopatch.register_hooks = spy


class LegacyLoader:
    # PEP 302 only, as zipimport before Python 3.10 and old import hooks.
    def load_module(self, fullname):
        module = sys.modules[fullname] = types.ModuleType(fullname)
        module.__loader__ = self
        return module


class PlainLoader:
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


class ReadOnlySpec(importlib.machinery.ModuleSpec):
    # A spec whose loader cannot be replaced: no loader can be lent for this import.
    def __setattr__(self, name, value):
        if name == "loader" and "loader" in vars(self):
            raise AttributeError("read-only loader")
        super().__setattr__(name, value)


class StandInFinder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        if KIND == "legacy":
            return importlib.machinery.ModuleSpec(fullname, LegacyLoader())
        return ReadOnlySpec(fullname, PlainLoader())


watcher = next((f for f in sys.meta_path if type(f).__name__ == 'FirstImportWatcher'), None)
sys.meta_path.insert(0 if watcher is None else 1, StandInFinder())
try:
    import torch.distributed.fsdp as fsdp
    outcome = type(fsdp.__loader__).__name__
except Exception as error:
    outcome = type(error).__name__
armed_in_import = "wrapt" in sys.modules
import colorsys  # noqa: E402, F401 (the next import after it)

wrapt = sys.modules.get("wrapt")
print(json.dumps({
    "outcome": outcome, "held": held, "armed_in_import": armed_in_import,
    "watching": watcher in sys.meta_path,
    "waiting_hooks": sorted(wrapt.importer._post_import_hooks) if wrapt else None,
}))
