"""The package's own probe, for tests/conftest.py's ``layout_bug_here()``: torch's construction
applied to a throwaway ABC module, the swap tried by CPython. One JSON line: ``{"bug": ...}``.

    FSDP_AUTOPATCH=0 python tests/probe_layout_bug.py
"""

import json

import torch.distributed.fsdp  # noqa: F401 (FSDP2, whose construction is probed)

from fsdp_autopatch import _patch

print(json.dumps({"bug": _patch.probe_layout_bug()}))
