"""A torch whose FSDP2 or FSDP2-replicate module no longer has ``_unimplemented_deepcopy`` where
the package's site table says, for tests/test_hooks.py; prints the status as JSON lines.

    python tests/programs/moved_name.py fsdp2-then-transformers|transformers-then-fsdp2|replicate [--keep]

fsdp2-then-transformers: FSDP2's name moved; the status after FSDP2, then after transformers.
transformers-then-fsdp2: the same name moved; the status after both.
replicate: replicate_with_fsdp's name moved, force mode applied; the status.
``--keep``: the same imports with torch's names where they are.
"""

from __future__ import annotations

import json
import sys

from intercept_import import move_name

FULLY_SHARD_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"
REPLICATE_MODULE = "torch.distributed._composable.replicate_with_fsdp"
MOVED = "_unimplemented_deepcopy"


def status() -> dict[str, object]:
    import fsdp_autopatch

    return fsdp_autopatch.status().to_dict()


def main(part: str, keep: bool) -> None:
    if not keep:
        move_name(REPLICATE_MODULE if part == "replicate" else FULLY_SHARD_MODULE, MOVED)
    # The imports' order is what is under test.
    # isort: off
    if part == "fsdp2-then-transformers":
        import torch.distributed.fsdp

        print(json.dumps({"at_fsdp2": status()}))
        import transformers

        print(json.dumps({"at_transformers": status()}))
    elif part == "transformers-then-fsdp2":
        import transformers
        import torch.distributed.fsdp

        print(json.dumps(status()))
    else:
        import torch.distributed.fsdp
        import transformers  # noqa: F401 (an affected release arms the patch)
        import torch.distributed._composable.replicate_with_fsdp  # noqa: F401 (the site under test)
        import fsdp_autopatch

        fsdp_autopatch.apply()
        print(json.dumps(status()))
    # isort: on

if __name__ == "__main__":
    main(sys.argv[1], "--keep" in sys.argv[2:])
