"""Shard ``class Head(abc.ABC, nn.Linear)`` with FSDP2 after importing torch's FSDP2 and
transformers, for the tests; print the package's status before and after, and the error.

    python tests/programs/shard_abc_head.py [--finder ahead|behind] [--calls apply|apply-then-force]

``--finder``: a finder that asks every finder (tests/programs/delegating_finder.py) goes onto
sys.meta_path first, before any import. ``--calls``: what runs after the imports.
"""

from __future__ import annotations

import argparse
import sys

import delegating_finder

CALLS = ("apply", "apply-then-force")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--finder", choices=("ahead", "behind"))
    parser.add_argument("--calls", choices=CALLS)
    options = parser.parse_args()
    if options.finder:
        delegating_finder.install(options.finder)

    import abc
    import json

    import torch.distributed.fsdp  # noqa: F401
    import transformers
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fully_shard

    import fsdp_autopatch
    from fsdp_autopatch import _patch, _verify

    before = fsdp_autopatch.status().to_dict()
    cache = _fully_shard.cls_to_fsdp_cls
    if options.calls:
        fsdp_autopatch.apply()
    if options.calls == "apply-then-force":
        fsdp_autopatch.apply(force=True)

    class Head(abc.ABC, nn.Linear):
        pass

    mesh = _verify.init_process_group()
    try:
        fully_shard(Head(4, 4), mesh=mesh)
        error = None
    except TypeError as caught:
        error = str(caught)
    helper_module = vars(sys.modules["torch.distributed.fsdp._fully_shard._fsdp_init"])
    builder = helper_module.get(_patch.PRIVATE_TYPE)
    print(json.dumps({"before": before, "after": fsdp_autopatch.status().to_dict(), "error": error,
                      "transformers": transformers.__version__,
                      "cache_kept": _fully_shard.cls_to_fsdp_cls is cache,
                      "cache_type": type(cache).__name__,
                      "module_binds_type": "type" in helper_module,
                      "stand_in": [type(builder).__name__, len(getattr(builder, "constructions", ()))]}))


if __name__ == "__main__":
    main()
