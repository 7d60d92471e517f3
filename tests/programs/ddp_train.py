"""One rank, for tests/test_ddp.py: the imports in the order given, then composable DDP's runs of
fsdp_autopatch._verify (replicate the root, train next to an unreplicated copy). Prints the
status line (and whether FSDP2 was imported), then one JSON line per run, with its rank.

    python tests/programs/ddp_train.py IMPORTS RUN...    # IMPORTS as import_order.py reads them
"""

from __future__ import annotations

import json
import os
import sys

from import_order import import_modules


def main(imports: str, runs: list[str]) -> None:
    import_modules(imports)

    import fsdp_autopatch
    from fsdp_autopatch import _verify

    mesh = _verify.init_process_group()
    print(json.dumps({"status": fsdp_autopatch.status().to_dict(),
                      "fsdp2_imported": "torch.distributed.fsdp" in sys.modules}), flush=True)
    for run in runs:
        result = _verify.shard_and_train(run, mesh)
        result["rank"] = int(os.environ.get("RANK", "0"))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
