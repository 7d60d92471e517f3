"""A process that would say the one line: it imports FSDP2 and transformers (with wrapt missing,
the fix cannot run), for tests/test_speaker.py. Then it waits and exits as asked.

    python tests/programs/speak.py [--basic-config] [--meet DIR N] [--hold FILE] [--os-exit]

--basic-config  logging.basicConfig(level=logging.INFO) first, as training scripts do
--meet DIR N    after the imports, leave a file in DIR and wait until N processes have (so that
                each has decided before any exits)
--hold FILE     after the imports, create FILE and wait until killed
--os-exit       end with os._exit(0): no atexit handler, no interpreter teardown
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

MEET_TIMEOUT = 120.0


def meet(directory: Path, count: int) -> None:
    """Leave this process's file in ``directory``, then wait until ``count`` files are there."""
    (directory / str(os.getpid())).touch()
    deadline = time.monotonic() + MEET_TIMEOUT
    while len(list(directory.iterdir())) < count:
        if time.monotonic() > deadline:
            sys.exit(f"speak.py: {count} processes did not meet in {directory} in {MEET_TIMEOUT:g} s")
        time.sleep(0.01)


def main(argv: list[str]) -> None:
    if "--basic-config" in argv:
        logging.basicConfig(level=logging.INFO)
    import torch.distributed.fsdp  # noqa: F401
    import transformers  # noqa: F401

    if "--meet" in argv:
        at = argv.index("--meet")
        meet(Path(argv[at + 1]), int(argv[at + 2]))
    if "--hold" in argv:
        Path(argv[argv.index("--hold") + 1]).touch()
        while True:
            time.sleep(60)
    sys.stderr.flush()
    if "--os-exit" in argv:
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
