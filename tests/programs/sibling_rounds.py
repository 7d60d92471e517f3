"""Rounds of N siblings forked at once, each importing FSDP2 and transformers the same instant,
for tests/test_speaker.py: one JSON line per round, the lines the siblings printed.

    python tests/programs/sibling_rounds.py ROUNDS N

The parent imports neither (nothing of the package has decided here). In each round the
children share one pipe as stderr, wait at a gate the parent opens for all at once, import, then
wait until every sibling has imported before they exit, as forked ranks (os._exit) do.
"""

from __future__ import annotations

import json
import os
import sys


def child(stderr: int, gate: int, done: int, leave: int) -> None:
    os.dup2(stderr, 2)
    os.read(gate, 1)
    try:
        import torch.distributed.fsdp  # noqa: F401
        import transformers  # noqa: F401

        sys.stderr.flush()
    finally:
        os.write(done, b".")
        os.read(leave, 1)
        os._exit(0)


def one_round(count: int) -> list[str]:
    stderr_read, stderr_write = os.pipe()
    gate_read, gate_write = os.pipe()
    done_read, done_write = os.pipe()
    leave_read, leave_write = os.pipe()
    pids = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            child(stderr_write, gate_read, done_write, leave_read)
        pids.append(pid)
    os.write(gate_write, b"." * count)  # all of them at once
    arrived = 0
    while arrived < count:
        arrived += len(os.read(done_read, count))
    os.write(leave_write, b"." * count)
    for pid in pids:
        os.waitpid(pid, 0)
    for end in (stderr_write, gate_read, gate_write, done_read, done_write, leave_read, leave_write):
        os.close(end)
    with os.fdopen(stderr_read, encoding="utf-8", errors="replace") as said:
        return said.read().splitlines()


def main(rounds: int, count: int) -> None:
    for number in range(rounds):
        print(json.dumps({"round": number, "lines": one_round(count)}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
