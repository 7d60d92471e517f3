"""A user's training process, for the tests: import torch's FSDP2 and transformers in a chosen
order (or from many threads at once), then run the tiny-model proof of fsdp_autopatch._verify.

    python tests/programs/scenario.py [--order fsdp-first|transformers-first|threads] [model ...]

Prints the proof's JSON lines; runs as one rank, or as every rank under torchrun.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import threading

FSDP, TRANSFORMERS = "torch.distributed.fsdp", "transformers"


def import_in_threads(seed: int = 0, count: int = 16) -> None:
    """``count`` threads, released together, each importing both packages in an order drawn
    from ``seed``; exits the process when an import fails or a thread hangs."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        names = [FSDP, TRANSFORMERS]
        random.Random(seed * 1000 + index).shuffle(names)
        barrier.wait()  # released together, so the first imports really do race
        try:
            for name in names:
                importlib.import_module(name)
        except BaseException as error:  # reported below, in the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(index,), daemon=True) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors or any(thread.is_alive() for thread in threads):
        raise SystemExit(f"threaded imports failed: {errors or 'a thread hung'}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--order", choices=("fsdp-first", "transformers-first", "threads"),
                        default="fsdp-first")
    parser.add_argument("models", nargs="*")
    options = parser.parse_args()
    if options.order == "threads":
        import_in_threads()
    else:
        first, second = (FSDP, TRANSFORMERS) if options.order == "fsdp-first" else (TRANSFORMERS, FSDP)
        importlib.import_module(first)
        importlib.import_module(second)
    from fsdp_autopatch import _verify

    return _verify.main(options.models)


if __name__ == "__main__":
    sys.exit(main())
