"""A small stdlib timing harness: alternate A/B runs, medians, pairwise ratios, ``-X importtime``.

The helpers shared with the tests (the environment scrubber, the ``-X importtime`` parser) come
from ``tests/harness.py``, which ``run.py`` puts on ``sys.path``.

Runs of the things being compared are interleaved (A B, then B A, ...) rather than done in
blocks, so that drift on a noisy machine (another process starting, the CPU clock changing)
lands on both sides alike. A ratio is the median of per-round ratios B_i / A_i, with a
distribution-free 95% confidence interval, so "within noise" has a stated meaning: the interval
contains 1.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from harness import split_importtime

T = TypeVar("T")


class MeasurementError(RuntimeError):
    """A measurement could not be taken (a child failed, printed nothing usable, ...)."""


@dataclass(frozen=True)
class Command:
    """One thing to time: a child process, always started from a neutral directory."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str


def run_checked(command: Command, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        command.argv, env=command.env, cwd=command.cwd, capture_output=True, text=True,
        timeout=timeout, check=False,
    )
    if result.returncode != 0:
        raise MeasurementError(
            f"{' '.join(command.argv)} exited {result.returncode}:\n{result.stderr[-3000:]}"
        )
    return result


def wall_seconds(command: Command, timeout: float = 900) -> float:
    """Wall time of one run, output discarded; a failed run is an error, not a sample."""
    started = time.perf_counter()
    returncode = subprocess.run(
        command.argv, env=command.env, cwd=command.cwd, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, timeout=timeout, check=False,
    ).returncode
    elapsed = time.perf_counter() - started
    if returncode != 0:
        run_checked(command, timeout)  # again, to get the error text into the exception
        raise MeasurementError(f"{' '.join(command.argv)} failed once, then passed: flaky")
    return elapsed


def alternate(
    measures: dict[str, Callable[[], T]], rounds: int, warmup: int = 1
) -> dict[str, list[T]]:
    """Call every measure once per round, rotating the order each round; warm-up rounds are
    dropped (they pay for cold file caches, not for what is being compared)."""
    labels = list(measures)
    samples: dict[str, list[T]] = {label: [] for label in labels}
    for index in range(warmup + rounds):
        shift = index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            value = measures[label]()
            if index >= warmup:
                samples[label].append(value)
    return samples


@dataclass(frozen=True)
class Ratio:
    """Median of pairwise ratios with a 95% interval (order statistics of the ratios)."""

    median: float
    low: float
    high: float
    pairs: int

    @property
    def within_noise(self) -> bool:
        return self.low <= 1.0 <= self.high

    def to_dict(self) -> dict[str, float]:
        return {"median": self.median, "ci95_low": self.low, "ci95_high": self.high, "pairs": self.pairs}


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """A distribution-free ~95% interval for the median: the k-th smallest and largest values,
    k from the normal approximation to Binomial(n, 1/2). With fewer than 6 values no such
    interval reaches 95%, and the full range is returned."""
    ordered = sorted(values)
    count = len(ordered)
    k = math.floor((count - 1.96 * math.sqrt(count)) / 2)
    if k < 1:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[count - k]


def pairwise_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> Ratio:
    if not numerators or len(numerators) != len(denominators):
        raise MeasurementError(f"cannot pair {len(numerators)} samples with {len(denominators)}")
    ratios = [a / b for a, b in zip(numerators, denominators)]
    low, high = median_interval(ratios)
    return Ratio(statistics.median(ratios), low, high, len(ratios))


def importtime(command: Command) -> dict[str, int]:
    """Self import time in microseconds per module, from one run with ``-X importtime``."""
    argv = (command.argv[0], "-X", "importtime", *command.argv[1:])
    result = run_checked(Command(argv, command.env, command.cwd))
    times, _ = split_importtime(result.stderr)
    if not times:
        raise MeasurementError(f"no -X importtime lines from {' '.join(argv)}")
    return times


def loaded_modules(python: str, code: str, env: dict[str, str], cwd: str) -> set[str]:
    """``sys.modules`` after running ``code``, listed from inside the child.

    The listing code imports nothing that start-up has not already imported (``sys`` is always
    there), so the names are what start-up plus ``code`` loaded.
    """
    listing = f"{code}\nimport sys; print('\\n'.join(sorted(sys.modules)))"
    result = run_checked(Command((python, "-c", listing), env, cwd))
    return {line for line in result.stdout.splitlines() if line}
