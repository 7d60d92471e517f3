"""A Python process that starts N processes of tests/programs/speak.py and waits for them, as
launchers and notebook servers do, for tests/test_speaker.py:

    python tests/programs/starts_processes.py ranks|sessions|numbered N [--speak-first] [-- ARGS]

ranks       plain children, as a script that starts its ranks with subprocess
sessions    each child in a session of its own, as jupyter_client starts notebook kernels
numbered    each in a session of its own with LOCAL_RANK 0 .. N-1, as torchrun's agent starts
            ranks (accelerate's launcher is one)
--speak-first  import FSDP2 and transformers here first, as accelerate's launcher does
ARGS        given to every child (the children meet in a directory made here: --meet)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

SPEAK = Path(__file__).with_name("speak.py")


def main(kind: str, count: int, speak_first: bool, args: list[str]) -> int:
    if speak_first:
        import torch.distributed.fsdp  # noqa: F401
        import transformers  # noqa: F401
    with tempfile.TemporaryDirectory() as meeting:
        children = [
            subprocess.Popen(
                [sys.executable, str(SPEAK), "--meet", meeting, str(count), *args],
                start_new_session=kind != "ranks",
                env={**os.environ, **({"LOCAL_RANK": str(rank)} if kind == "numbered" else {})})
            for rank in range(count)
        ]
        codes = [child.wait() for child in children]
    return max(codes)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    rest = arguments[arguments.index("--") + 1:] if "--" in arguments else []
    sys.exit(main(arguments[0], int(arguments[1]), "--speak-first" in arguments[:3], rest))
