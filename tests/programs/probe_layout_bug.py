"""The package's own probe, for tests/conftest.py's ``layout_bug_here()`` and
tests/programs/probe_and_shard.py: torch's construction applied to a throwaway ABC module, the swap tried by
CPython, asked as the hooks ask it. Run, it prints one JSON line: ``{"bug": ...}``.

    FSDP_AUTOPATCH=0 python tests/programs/probe_layout_bug.py
"""

import json
from typing import Optional

import torch.distributed.fsdp  # noqa: F401 (FSDP2, whose construction is probed)

from fsdp_autopatch import _patch, _sites


def layout_bug(construction: Optional[_patch.Construction] = None) -> Optional[bool]:
    """Does CPython refuse the class torch's construction builds for an ABC module at a site (the
    first the loaded torch has, by default)? None: it cannot be asked."""
    if construction is None:
        construction = next(filter(None, map(_patch.resolve_api, _sites.APIS)), None)
    answer = _patch.probe(construction) if construction is not None else None
    return None if answer is None else answer == _patch.TORCH_REFUSED


if __name__ == "__main__":
    print(json.dumps({"bug": layout_bug()}))
