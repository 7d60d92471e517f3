"""``import torch`` alone, for tests/test_plugin.py: the package's modules then loaded, whether
wrapt is, and which route armed the package. One JSON line.

    python [-S] tests/programs/torch_alone_imports.py
"""

import json
import sys

import torch  # noqa: F401 (its plugin entry points run at the end of this import)

import fsdp_autopatch

print(json.dumps({"ours": sorted(m for m in sys.modules if "fsdp_autopatch" in m),
                  "wrapt": "wrapt" in sys.modules, "armed_by": fsdp_autopatch.armed_by}))
