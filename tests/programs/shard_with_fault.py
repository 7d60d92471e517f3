"""A fault injected into the package (or torch's names moved) before the first import, then the
imports, then one sharded train step of the ABC-headed token classifier, for
tests/test_faults.py; one JSON line: the status and the run's result.

    python tests/programs/shard_with_fault.py [--fault NAME] [--imports SPEC]

``--fault``: one of FAULTS below (none by default). ``--imports``: as tests/programs/import_order.py
reads them (FSDP2, then transformers, by default).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Callable

from import_order import import_modules

DEFAULT_IMPORTS = "torch.distributed.fsdp,transformers"
FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"
moved: dict[str, Any] = {}


def raising(module: str, name: str, error: type[Exception]) -> Callable[[], None]:
    """A fault: the package's ``module.name`` replaced by a function that raises ``error``
    with the message "injected: name"."""

    def inject() -> None:
        def fail(*args: Any, **kwargs: Any) -> None:
            raise error(f"injected: {name}")

        setattr(importlib.import_module(module), name, fail)

    return inject


def failing_replicate_site() -> None:
    # fully_shard's site succeeds; the step after it, for another site, fails.
    import fsdp_autopatch._patch as patch

    real_install = patch.install

    def install(construction: Any) -> Any:
        if construction.site.api != "FSDP2 fully_shard":
            raise RuntimeError("injected: replicate site")
        return real_install(construction)

    patch.install = install


def hide_fsdp_names() -> None:
    # torch "moves" the names this package patches: they are gone from the module's globals when
    # the package's hook looks, as they would be in a torch release that renamed them.
    import wrapt

    def move_names(module: Any) -> None:
        # Runs before the package's own hook: wrapt calls hooks in the order they were registered.
        moved["_unimplemented_deepcopy"] = sys.modules[FULLY_SHARD].__dict__.pop("_unimplemented_deepcopy")

    # The site's own module: the package's hook patches a site as soon as its module has run.
    wrapt.register_post_import_hook(move_names, FULLY_SHARD)


FAULTS: dict[str, Callable[[], None]] = {
    "install": raising("fsdp_autopatch._patch", "install", RuntimeError),
    "decide": raising("fsdp_autopatch._matrix", "decide", ValueError),
    "replicate site": failing_replicate_site,
    "mirror": raising("fsdp_autopatch._wrapper_cls", "_mirror_for", RuntimeError),
    "hide fsdp names": hide_fsdp_names,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=list(FAULTS))
    parser.add_argument("--imports", default=DEFAULT_IMPORTS)
    options = parser.parse_args()
    if options.fault:
        FAULTS[options.fault]()
    import torch.distributed as dist

    import_modules(options.imports)
    if "_unimplemented_deepcopy" in moved:
        # torch's own code looks the stub up by this name, so it goes back for fully_shard to run.
        sys.modules[FULLY_SHARD]._unimplemented_deepcopy = moved["_unimplemented_deepcopy"]  # type: ignore[attr-defined]

    import fsdp_autopatch
    from fsdp_autopatch import _verify

    mesh = _verify.init_process_group()
    result = _verify.shard_and_train("token-classification", mesh, steps=1)
    dist.destroy_process_group()
    print(json.dumps({"status": fsdp_autopatch.status().to_dict(), "result": result}))


if __name__ == "__main__":
    main()
