"""The imports a test program starts with, in the order a test names, for the programs that are
about import order (tests/programs/ddp_train.py, ddp_users_own.py, replicate_train.py).

    import_modules("transformers,thread:torch.distributed._composable.replicate")

Each comma-separated module is imported in turn; ``thread:NAME`` imports NAME from a worker
thread, joined before the next.
"""

from __future__ import annotations

import importlib
import threading

THREAD = "thread:"


def import_modules(spec: str) -> None:
    for name in filter(None, spec.split(",")):
        if name.startswith(THREAD):
            worker = threading.Thread(target=importlib.import_module, args=(name[len(THREAD):],))
            worker.start()
            worker.join()
        else:
            importlib.import_module(name)


def spec(*names: str) -> str:
    """The argument for ``import_modules``, for the tests."""
    return ",".join(names)
