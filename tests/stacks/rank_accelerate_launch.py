"""A training script as ``accelerate launch`` runs it with accelerate's own FSDP2 config
(``fsdp_version: 2``) on a CPU: prepare a reward model and say what accelerate made of it.

    accelerate launch --config_file CONFIG tests/stacks/rank_accelerate_launch.py

Each rank prints one JSON line: its LOCAL_RANK, accelerate's ``distributed_type``, the class
``prepare`` returned and whether FSDP2 sharded anything. The launcher imports accelerate, and
through it transformers and FSDP2, before it starts these ranks (tests/stacks/test_accelerate.py).
"""

from __future__ import annotations

import json
import os

from rank_common import build, is_sharded


def main() -> None:
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator()
    model = build()
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inner = getattr(model, "module", model)
    print(json.dumps({"local_rank": os.environ.get("LOCAL_RANK"),
                      "distributed_type": str(accelerator.state.distributed_type),
                      "prepared": type(model).__name__, "sharded": is_sharded(inner)}), flush=True)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
