"""A main module that imports FSDP2 and transformers at the top, then starts N processes with
multiprocessing's spawn, as torch.multiprocessing.spawn does (each child imports this module
again, as ``__mp_main__``), for tests/test_speaker.py:

    python tests/programs/spawn_after_imports.py N
"""

from __future__ import annotations

import multiprocessing
import sys

import torch.distributed.fsdp  # noqa: F401
import transformers  # noqa: F401


def rank(index: int) -> None:
    sys.stderr.flush()


def main(count: int) -> int:
    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=rank, args=(index,)) for index in range(count)]
    for child in children:
        child.start()
    for child in children:
        child.join()
    return max(child.exitcode or 0 for child in children)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
