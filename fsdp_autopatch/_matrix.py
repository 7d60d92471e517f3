"""The version matrix: which torch and transformers releases have the bug, with the evidence.

The patch is installed only where the bug is: a transformers release whose heads inherit
``abc.ABC`` and a torch release whose FSDP2 builds layout-incompatible classes. Every row says
what was read or run to establish it. A torch newer than the last row is judged by behaviour
(``Decision`` takes a probe), so the patch switches itself off once upstream fixes the
construction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from fsdp_autopatch import _config

Release = tuple[int, ...]


@dataclass(frozen=True)
class Row:
    package: str
    first: Release  # inclusive
    end: Optional[Release]  # exclusive; None: no upper end
    affected: bool
    evidence: str

    def covers(self, numbers: Release) -> bool:
        return _significant(self.first) <= numbers and (
            self.end is None or numbers < _significant(self.end)
        )

    @property
    def span(self) -> str:
        first = ".".join(map(str, self.first))
        return f">={first}" + (f",<{'.'.join(map(str, self.end))}" if self.end else "")


TRANSFORMERS_ROWS = (
    Row("transformers", (0,), (4, 54, 0), False,
        "4.53.3 and older define no Generic* heads with abc.ABC"),
    Row("transformers", (4, 54, 0), (4, 55, 3), True,
        "4.54.0, 4.54.1, 4.55.0, 4.55.1, 4.55.2: GenericFor{SequenceClassification,"
        "QuestionAnswering,TokenClassification}(ABC) in modeling_layers.py"),
    Row("transformers", (4, 55, 3), None, False,
        "4.55.3 and newer (4.56, 4.57, 5.x): those heads no longer inherit ABC"),
)

TORCH_ROWS = (
    Row("torch", (0,), (2, 4), False, "no FSDP2 fully_shard before 2.4"),
    Row("torch", (2, 4), (2, 5), True,
        "2.4.1 read: _composable/fsdp/fully_shard.py builds FSDP<Name>(FSDPModule, cls) inline, "
        "no class cache; 2.4.1 + transformers 4.55.2 run: layout error, fixed by the inline "
        "site (its FSDP2 trains only on CUDA, so no train step on CPU)"),
    Row("torch", (2, 5), (2, 6), True,
        "2.5.1 read: _composable/fsdp/fully_shard.py, cls_to_fsdp_cls cache, same construction; "
        "2.5.1 + transformers 4.54.0 run: layout error, fixed (its FSDP2 trains only on CUDA)"),
    Row("torch", (2, 6), (2, 11), True,
        "2.6.0, 2.8.0, 2.9.1, 2.10.0 read: fsdp/_fully_shard/_fully_shard.py, same construction "
        "and cache; 2.8.0 + transformers 4.55.2 run: layout error"),
    Row("torch", (2, 11), (2, 16), True,
        "2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0 read: _fsdp_init._apply_to_module, same "
        "construction; 2.13.0 + transformers 4.54.0 and 4.55.2, 2.15.0 + transformers 4.55.2 run: "
        "layout error"),
)

_RELEASE_PATTERN = re.compile(r"\s*v?(?:\d+!)?(\d+(?:\.\d+)*)")


def release(version: str) -> Release:
    """The release numbers of a version: ``2.8.0+cu128`` and ``2.8.0rc1`` are both (2, 8, 0).

    Pre-releases, dev builds and local tags count as the release they lead to, so a nightly
    ``2.9.0.dev20250801`` is judged as torch 2.9.0.
    """
    match = _RELEASE_PATTERN.match(str(version))
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return _significant(tuple(int(part) for part in match.group(1).split(".")))


def _significant(numbers: Release) -> Release:
    """Drop trailing zeros, so that 2.6, 2.6.0 and 2.6.0.0 compare equal."""
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers = numbers[:-1]
    return numbers


def row_for(rows: tuple[Row, ...], version: str) -> Optional[Row]:
    numbers = release(version)
    return next((row for row in rows if row.covers(numbers)), None)


@dataclass(frozen=True)
class Decision:
    apply: bool
    reason: str
    # True: the pair is in a row that has the bug; False: rows say no bug; None: not in the rows.
    in_matrix: Optional[bool]


# A probe answers "does this torch still build layout-incompatible classes?" by trying it;
# None when it cannot tell.
Probe = Callable[[], Optional[bool]]


def decide(
    mode: str,
    torch_version: Optional[str],
    transformers_version: Optional[str],
    probe: Optional[Probe] = None,
) -> Decision:
    """Should the patch be installed for this mode and these versions?"""
    if mode == _config.OFF:
        return Decision(False, f"disabled by {_config.MODE_VARIABLE}", None)
    if torch_version is None:
        return Decision(False, "torch is not installed: there is nothing to patch", None)
    torch_row = row_for(TORCH_ROWS, torch_version)
    if torch_row is not None and not torch_row.affected:
        return Decision(False, f"torch {torch_version} has no FSDP2 ({torch_row.evidence})", False)
    if mode == _config.FORCE:
        return Decision(True, f"{_config.MODE_VARIABLE}=force: patching torch {torch_version} "
                              "whatever the matrix says", None)
    if transformers_version is None:
        return Decision(False, "transformers is not installed, and only its 4.54.0-4.55.2 "
                               f"heads need the patch (set {_config.MODE_VARIABLE}=force for "
                               "your own ABC modules)", None)
    transformers_row = row_for(TRANSFORMERS_ROWS, transformers_version)
    assert transformers_row is not None  # the rows cover every release
    if not transformers_row.affected:
        return Decision(False, f"transformers {transformers_version} is not affected "
                               f"({transformers_row.evidence}); set {_config.MODE_VARIABLE}=force "
                               "for your own ABC modules", False)
    pair = f"torch {torch_version} with transformers {transformers_version}"
    if torch_row is not None:
        return Decision(True, f"{pair} has the bug ({torch_row.evidence})", True)
    still_broken = probe() if probe is not None else None
    if still_broken is None:
        return Decision(False, f"torch {torch_version} is newer than the matrix and its FSDP "
                               "class construction could not be checked; set "
                               f"{_config.MODE_VARIABLE}=force to patch anyway", None)
    if still_broken:
        return Decision(True, f"{pair}: torch is newer than the matrix, but a probe shows it still "
                              "builds layout-incompatible FSDP classes", None)
    return Decision(False, f"torch {torch_version} builds layout-compatible FSDP classes (probed): "
                           "fixed upstream, nothing to do", False)
