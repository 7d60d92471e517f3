"""The version matrix: which torch, transformers and Python releases have the bug, with the evidence.

The patch is installed only where the bug is: a transformers release whose heads inherit
``abc.ABC``, a torch whose wrappers build their classes by ``type(f"FSDP{name}", (FSDPModule,
cls), ...)``, and a CPython that refuses that class for an ABC module. Whether torch and CPython
still refuse is asked of them directly, at every site, by a probe (``_patch.probe``);
the rows below are the documented evidence, and the answer only where no probe can run
(``doctor``, which imports no torch, or a torch whose construction cannot be found). A torch
release is one row, which says what was read or run of it; where a release builds its classes
is ``_sites``' table. tests/version_table.py writes docs/versions.md's table from both.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Optional, TypeVar

from fsdp_autopatch import _config

Release = tuple[int, ...]

# Who answered "is the bug here?", as Decision.decided_by and status().decided_by name it: the
# probe (_patch.probe asked torch and CPython), or the rows below.
DECIDED_BY_PROBE = "probe"
DECIDED_BY_MATRIX = "matrix"


@dataclass(frozen=True)
class Row:
    """A range of one package's releases, and what was read or run of them. Each table's rows add
    the one fact it records about the range."""

    package: str
    first: Release  # inclusive
    end: Optional[Release]  # exclusive; None: no upper end
    evidence: str
    last: Optional[Release] = None  # the newest release of a range that was read

    def covers(self, numbers: Release) -> bool:
        return _significant(self.first) <= numbers and (
            self.end is None or numbers < _significant(self.end)
        )


@dataclass(frozen=True)
class TransformersRow(Row):
    abc_heads: bool = False  # its classification and QA heads inherit abc.ABC first


@dataclass(frozen=True)
class TorchRow(Row):
    has_fsdp2: bool = True  # FSDP2's fully_shard is there, and swaps module classes
    # Every site builds, for an ABC module, a class CPython accepts itself: torch's own fix.
    fixed: bool = False


@dataclass(frozen=True)
class PythonRow(Row):
    refuses_abc_swap: bool = True  # CPython refuses torch's class for an ABC-first module


TRANSFORMERS_ROWS = (
    TransformersRow("transformers", (0,), (4, 54, 0),
                    "4.53.3 and older define no Generic* heads with abc.ABC"),
    TransformersRow("transformers", (4, 54, 0), (4, 55, 3),
                    "4.54.0, 4.54.1, 4.55.0, 4.55.1, 4.55.2 read: GenericFor{SequenceClassification,"
                    "QuestionAnswering,TokenClassification}(ABC) in modeling_layers.py (transformers#39977; "
                    "removed by #40191)", last=(4, 55, 2), abc_heads=True),
    TransformersRow("transformers", (4, 55, 3), None,
                    "4.55.3 and newer (4.56, 4.57, 5.x) read: those heads no longer inherit ABC"),
)
_ABC_HEADS = next(row for row in TRANSFORMERS_ROWS if row.abc_heads)
# "4.54.0-4.55.2", for messages and help.
ABC_HEADS_TRANSFORMERS = "-".join(".".join(map(str, numbers))
                                  for numbers in (_ABC_HEADS.first, _ABC_HEADS.last))


def _torch(minor: int, evidence: str, fixed: bool = False) -> TorchRow:
    """One torch release with FSDP2 (2.<minor>.x), and what was read or run of it; ``fixed``: a
    release whose every site builds classes CPython accepts itself (torch's own fix)."""
    return TorchRow("torch", (2, minor), (2, minor + 1), evidence, fixed=fixed)


# One row per torch release. Every one with FSDP2 has the bug: no release up to 2.15.0 builds a
# class CPython accepts for an ABC module (pytorch#160068; a fix promised for 2.9 never shipped);
# the first that does is ``_torch(minor, evidence, fixed=True)``.
TORCH_ROWS = (
    TorchRow("torch", (0,), (2, 4), "no FSDP2 fully_shard before 2.4", has_fsdp2=False),
    _torch(4, "2.4.1 read: _composable/fsdp/fully_shard.py builds FSDP<Name>(FSDPModule, cls) inline, "
              "no class cache; composable DDP's replicate builds DDP<Name>(DDP, cls) inline; run with "
              "transformers 4.55.2: layout error, fixed (its FSDP2 trains only on CUDA)"),
    _torch(5, "2.5.1 read: the same module, with the cls_to_fsdp_cls cache; run with transformers "
              "4.54.0: layout error, fixed (its FSDP2 trains only on CUDA)"),
    _torch(6, "2.6.0 read: fsdp/_fully_shard/_fully_shard.py, the same construction and cache"),
    _torch(7, "2.7.1 swept: its __class__ assignments are 2.6.0's (fully_shard, composable DDP)"),
    _torch(8, "2.8.0 read: as 2.6.0; run with transformers 4.55.2: layout error, fixed"),
    _torch(9, "2.9.1 read: as 2.6.0; FSDP2 replicate's replicate_impl builds Replicate<Name>"
              "(FSDPModule, cls) inline with cls_to_replicate_cls"),
    _torch(10, "2.10.0 read: as 2.9.1, replicate_impl with (ReplicateModule, cls); run with "
               "transformers 4.55.2: layout error, fixed"),
    _torch(11, "2.11.0 read: fully_shard and FSDP2 replicate built by _fsdp_init._apply_to_module"),
    _torch(12, "2.12.1 read: as 2.11.0"),
    _torch(13, "2.13.0 read: as 2.11.0; run with transformers 4.54.0 and 4.55.2: layout error, fixed"),
    _torch(14, "2.14.1 read: as 2.11.0"),
    _torch(15, "2.15.0 read: as 2.11.0 (_fsdp_init.py lines 404-430, replicate.py 245-248); run "
               "with transformers 4.55.2: layout error"),
)

# The first torch whose import torch calls the torch.backends entry points (2.5.1 - 2.15.0
# read: torch/__init__.py, _import_device_backends; 2.4.1 has none): the plugin route.
PLUGIN_FIRST_TORCH: Release = (2, 5)

# CPython decides the swap itself (compatible_for_assignment in Objects/typeobject.c); torch
# only builds the class it is asked to accept. The rows are about the ABC case the
# transformers heads hit; other empty-__slots__ parents are asked per class at run time.
PYTHON_ROWS = (
    PythonRow("python", (0,), (3, 15),
              "CPython 3.9.18, 3.10.13, 3.11.7, 3.12.1, 3.13.0 and 3.14.10 run: layout_repro.py refuses "
              "the ABC, Generic[T] and collections.abc swaps alike (older Pythons are not supported)"),
    PythonRow("python", (3, 15), None,
              "CPython 3.15.2 run: layout_repro.py's ABC swaps accepted (gh-37817, PR #137585); torch "
              "2.15.0 + transformers 4.55.2 shard and train the three heads unpatched; Generic[T]-first "
              "and Protocol-first classes still refused", refuses_abc_swap=False),
)

# A whole PEP 440 version (the grammar of packaging.version), for interpreters without packaging:
# "2.8.0garbage" is not a version, "2.8.0+cu128" and "2.9.0.dev20250801" are.
_PEP_440 = re.compile(
    r"""v?(?:[0-9]+!)?(?P<release>[0-9]+(?:\.[0-9]+)*)
    (?:[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?[0-9]*)?
    (?:-[0-9]+|[-_.]?(?:post|rev|r)[-_.]?[0-9]*)?
    (?:[-_.]?dev[-_.]?[0-9]*)?
    (?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?""",
    re.VERBOSE | re.IGNORECASE,
)


def release(version: str) -> Release:
    """The release numbers of a version: ``2.8.0+cu128`` and ``2.8.0rc1`` are both (2, 8, 0).

    Pre-releases, dev builds and local tags count as the release they lead to, so a nightly
    ``2.9.0.dev20250801`` is judged as torch 2.9.0. Read by ``packaging`` where it is installed
    (transformers requires it), else by the same grammar here; raises ValueError for anything
    that is not a whole version.
    """
    text = str(version).strip()
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        match = _PEP_440.fullmatch(text)
        if match is None:
            raise ValueError(f"not a version: {version!r}") from None
        return _significant(tuple(int(part) for part in match["release"].split(".")))
    try:
        return _significant(Version(text).release)
    except InvalidVersion:
        raise ValueError(f"not a version: {version!r}") from None


def _significant(numbers: Release) -> Release:
    """Drop trailing zeros, so that 2.6, 2.6.0 and 2.6.0.0 compare equal."""
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers = numbers[:-1]
    return numbers


def release_or_none(version: Optional[str]) -> Optional[Release]:
    """``release(version)``; None for no version or an unreadable one."""
    try:
        return release(version) if version else None
    except ValueError:
        return None


RowOf = TypeVar("RowOf", bound=Row)


def row_for(rows: tuple[RowOf, ...], version: str) -> Optional[RowOf]:
    numbers = release(version)
    return next((row for row in rows if row.covers(numbers)), None)


def torch_row_for(version: Optional[str]) -> Optional[TorchRow]:
    """torch ``version``'s row; None for no torch, a release past the rows or an unreadable version."""
    numbers = release_or_none(version)
    return None if numbers is None else next((row for row in TORCH_ROWS if row.covers(numbers)), None)


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def interpreter(version: Optional[str] = None) -> str:
    """``CPython 3.11.7``: the rows and the probe speak about CPython's layout rule."""
    name = "CPython" if sys.implementation.name == "cpython" else sys.implementation.name
    return f"{name} {version or python_version()}"


@dataclass(frozen=True)
class Decision:
    apply: bool
    reason: str
    # What the rows say about the pair on this Python: True: the bug; False: no bug; None: the
    # rows do not cover it. The probe can overrule it; ``decided_by`` says who answered.
    in_matrix: Optional[bool]
    decided_by: Optional[str] = None  # DECIDED_BY_*; None where no bug question was asked
    # Neither the probe nor the rows could tell whether the bug is here: worth a warning.
    cannot_tell: bool = False


def decide(
    mode: str,
    torch_version: Optional[str],
    transformers_version: Optional[str],
    probed: Optional[bool] = None,
    python: Optional[str] = None,
) -> Decision:
    """Should the patch be installed for this mode, these versions and this Python?

    ``probed``: the probe's answer, whether CPython refuses the classes this torch builds for an
    ABC module (None: not asked, or it could not tell); where given, it decides, and the rows
    decide otherwise. ``python`` defaults to the running interpreter.
    """
    settled = _without_the_bug_question(mode, torch_version, transformers_version)
    if settled is not None:
        return settled
    assert torch_version is not None and transformers_version is not None
    return _bug_question(torch_version, transformers_version, probed, python)


def _without_the_bug_question(
    mode: str, torch_version: Optional[str], transformers_version: Optional[str]
) -> Optional[Decision]:
    """The decision where the switch, a missing package or a release row settles it before the
    bug is asked about; None where it must be asked."""
    if mode == _config.OFF:
        return Decision(False, f"disabled by {_config.MODE_VARIABLE}", None)
    if torch_version is None:
        return Decision(False, "torch is not installed: there is nothing to patch", None)
    torch_row = row_for(TORCH_ROWS, torch_version)
    if torch_row is not None and not torch_row.has_fsdp2:
        return Decision(False, f"torch {torch_version} has no FSDP2 ({torch_row.evidence})", False,
                        DECIDED_BY_MATRIX)
    if mode == _config.FORCE:
        return Decision(True, f"{_config.MODE_VARIABLE}=force: patching torch {torch_version} "
                              "whatever the matrix says; each class is still asked of CPython", None)
    if transformers_version is None:
        return Decision(False, f"transformers is not installed, and only its {ABC_HEADS_TRANSFORMERS} "
                               f"heads need the patch (set {_config.MODE_VARIABLE}=force for "
                               "your own ABC modules)", None)
    transformers_row = row_for(TRANSFORMERS_ROWS, transformers_version)
    assert transformers_row is not None  # the rows cover every release
    if not transformers_row.abc_heads:
        return Decision(False, f"transformers {transformers_version} is not affected "
                               f"({transformers_row.evidence}); set {_config.MODE_VARIABLE}=force "
                               "for your own ABC modules", False, DECIDED_BY_MATRIX)
    return None


def _bug_question(
    torch_version: str, transformers_version: str, probed: Optional[bool], python: Optional[str]
) -> Decision:
    """Is the bug here, for an affected transformers: the probe's answer, else the rows'."""
    pair = f"torch {torch_version} with transformers {transformers_version}"
    torch_row = row_for(TORCH_ROWS, torch_version)
    python_row = row_for(PYTHON_ROWS, python or python_version())
    assert python_row is not None  # the rows cover every release
    cpython = interpreter(python)
    fixed_by_torch = torch_row is not None and torch_row.fixed
    in_matrix = (False if not python_row.refuses_abc_swap or fixed_by_torch
                 else None if torch_row is None else True)
    if probed is True:
        return Decision(True, f"{pair} has the bug: {cpython} refuses torch {torch_version}'s wrapper "
                              "classes for ABC modules (probed)", in_matrix, DECIDED_BY_PROBE)
    if probed is False:
        return Decision(False, f"{cpython} accepts torch {torch_version}'s wrapper classes for "
                               "ABC modules (probed): nothing to patch", in_matrix, DECIDED_BY_PROBE)
    if in_matrix is True:
        assert torch_row is not None
        return Decision(True, f"{pair} has the bug on {cpython} (version matrix: "
                              f"{torch_row.evidence})", True, DECIDED_BY_MATRIX)
    if fixed_by_torch:
        assert torch_row is not None
        return Decision(False, f"torch {torch_version} builds wrapper classes {cpython} accepts for ABC "
                               f"modules itself (version matrix: {torch_row.evidence}): nothing to patch",
                        False, DECIDED_BY_MATRIX)
    if in_matrix is False:
        # The row's first release, not its evidence: the evidence names the CPython it was
        # measured on, often the very one running, which the reason already names.
        return Decision(False, f"{cpython} accepts torch's wrapper classes for ABC modules, as the "
                               f"version matrix has it for CPython {'.'.join(map(str, python_row.first))}"
                               f" and newer: nothing to patch (set {_config.MODE_VARIABLE}=force for "
                               "your own modules whose swap it still refuses)", False, DECIDED_BY_MATRIX)
    return Decision(False, f"torch {torch_version} is newer than the matrix and its class "
                           "construction could not be probed; set "
                           f"{_config.MODE_VARIABLE}=force to patch anyway", None, DECIDED_BY_MATRIX,
                    cannot_tell=True)
