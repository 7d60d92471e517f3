"""Import torch's FSDP2 and transformers, for tests/test_hooks.py; print whether the patch is
applied.

    python tests/import_both.py [--no-stderr]    # --no-stderr: sys.stderr is None first, as
                                                 # under pythonw and some services
"""

import sys

if "--no-stderr" in sys.argv:
    sys.stderr = None  # type: ignore[assignment]

import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
import transformers  # noqa: F401 (an affected release arms the patch)

import fsdp_autopatch

print(fsdp_autopatch.status().applied)
