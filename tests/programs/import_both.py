"""Import torch's FSDP2 and transformers, for tests/test_hooks.py; print whether the patch is
applied.

    python tests/programs/import_both.py [--no-stderr] [--log-info]

``--no-stderr``: sys.stderr is None first, as under pythonw and some services. ``--log-info``:
the application logs at INFO on stderr (``logging.basicConfig``), as an inference script may.
"""

import logging
import sys

if "--no-stderr" in sys.argv:
    sys.stderr = None  # type: ignore[assignment]
if "--log-info" in sys.argv:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")

import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
import transformers  # noqa: F401 (an affected release arms the patch)

import fsdp_autopatch

print(fsdp_autopatch.status().applied)
