"""The version matrix: which torch, transformers and Python releases have the bug, with the evidence.

The patch is installed only where the bug is: a transformers release whose heads inherit
``abc.ABC``, a torch whose FSDP2 builds wrapper classes by ``type(f"FSDP{name}", (FSDPModule,
cls), ...)``, and a CPython that refuses that class for an ABC module. Whether torch and CPython
still refuse is asked of them directly, by a probe (``_patch.probe_layout_bug``); the rows below
are the documented evidence, and the answer only where no probe can run (``doctor``, which
imports no torch, or a torch whose construction cannot be found). Every row says what was read
or run to establish it; ``render_version_table`` writes docs/versions.md's table from them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from fsdp_autopatch import _config

Release = tuple[int, ...]

_TO = " \N{EN DASH} "  # the docs' way of writing a range of releases

# Who answered "is the bug here?": the probe asked torch and CPython, or the rows below did.
PROBE = "probe"
MATRIX = "matrix"


@dataclass(frozen=True)
class Row:
    package: str
    first: Release  # inclusive
    end: Optional[Release]  # exclusive; None: no upper end
    affected: bool
    evidence: str
    versions: str  # as docs/versions.md shows them
    fact: str  # docs/versions.md's one-line summary

    def covers(self, numbers: Release) -> bool:
        return _significant(self.first) <= numbers and (
            self.end is None or numbers < _significant(self.end)
        )


TRANSFORMERS_ROWS = (
    Row("transformers", (0,), (4, 54, 0), False,
        "4.53.3 and older define no Generic* heads with abc.ABC",
        "≤ 4.53.3", "no `Generic*` heads with `abc.ABC`: not patched"),
    Row("transformers", (4, 54, 0), (4, 55, 3), True,
        "4.54.0, 4.54.1, 4.55.0, 4.55.1, 4.55.2: GenericFor{SequenceClassification,"
        "QuestionAnswering,TokenClassification}(ABC) in modeling_layers.py",
        "4.54.0, 4.54.1, 4.55.0, 4.55.1, 4.55.2",
        "`GenericFor{SequenceClassification,QuestionAnswering,TokenClassification}(ABC)`: patched"),
    Row("transformers", (4, 55, 3), None, False,
        "4.55.3 and newer (4.56, 4.57, 5.x): those heads no longer inherit ABC",
        "≥ 4.55.3 (4.56, 4.57, 5.x)", "the heads no longer inherit `ABC`: not patched"),
)
# "4.54.0-4.55.2": the affected row's first and last release, for messages and help.
_AFFECTED = next(row for row in TRANSFORMERS_ROWS if row.affected)
AFFECTED_TRANSFORMERS = f"{'.'.join(map(str, _AFFECTED.first))}-{_AFFECTED.versions.split(', ')[-1]}"

TORCH_ROWS = (
    Row("torch", (0,), (2, 4), False, "no FSDP2 fully_shard before 2.4", "< 2.4", "no FSDP2"),
    Row("torch", (2, 4), (2, 5), True,
        "2.4.1 read: _composable/fsdp/fully_shard.py builds FSDP<Name>(FSDPModule, cls) inline, "
        "no class cache; 2.4.1 + transformers 4.55.2 run: layout error, fixed by the inline "
        "site (its FSDP2 trains only on CUDA, so no train step on CPU)",
        "2.4", "`_composable/fsdp/fully_shard.py`, class built inline, no cache"),
    Row("torch", (2, 5), (2, 6), True,
        "2.5.1 read: _composable/fsdp/fully_shard.py, cls_to_fsdp_cls cache, same construction; "
        "2.5.1 + transformers 4.54.0 run: layout error, fixed (its FSDP2 trains only on CUDA)",
        "2.5", "same module, `cls_to_fsdp_cls` cache"),
    Row("torch", (2, 6), (2, 11), True,
        "2.6.0, 2.8.0, 2.9.1, 2.10.0 read: fsdp/_fully_shard/_fully_shard.py, same construction "
        "and cache; 2.8.0 + transformers 4.55.2 run: layout error",
        f"2.6{_TO}2.10", "`fsdp/_fully_shard/_fully_shard.py`, same construction and cache"),
    Row("torch", (2, 11), (2, 16), True,
        "2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0 read: _fsdp_init._apply_to_module, same "
        "construction; 2.13.0 + transformers 4.54.0 and 4.55.2, 2.15.0 + transformers 4.55.2 run: "
        "layout error",
        f"2.11{_TO}2.15", "built by `_fsdp_init._apply_to_module`"),
)

# torch.distributed.fsdp exports FSDP2's fully_shard from 2.6 on (2.6.0 - 2.15.0 read); 2.4 and
# 2.5 have it only in torch.distributed._composable.fsdp (_sites.FSDP2_PACKAGES), where the matrix
# runs on 2.4.1 and 2.5.1 import it, and their torch.distributed.fsdp is FSDP1.
FSDP2_IN_FSDP_PACKAGE: Release = (2, 6)

# FSDP2's replicate() builds Replicate<Name>(ReplicateModule or FSDPModule, cls) with its own cache
# (torch.distributed._composable.replicate_with_fsdp.cls_to_replicate_cls).
REPLICATE_ROW = Row(
    "torch", (2, 9), (2, 16), True,
    "2.9.1 and 2.10.0 read: replicate_with_fsdp.replicate_impl builds Replicate<Name> inline "
    "((FSDPModule, cls) in 2.9.1, (ReplicateModule, cls) in 2.10.0) with cls_to_replicate_cls; "
    "2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0 read: passed to _fsdp_init._apply_to_module like "
    "fully_shard's; 2.10.0 (its 1-D mesh named) and 2.13.0 + transformers 4.55.2 run: layout error, "
    "fixed; 2.4.1 - 2.8.0 have no replicate_with_fsdp",
    f"2.9{_TO}2.15",
    "FSDP2 `replicate()` (`_composable/replicate_with_fsdp.py`) builds `Replicate<Name>` the same way, "
    "with its own cache: patched",
)

# Composable DDP's replicate() builds DDP<Name>(DDP, cls) inline, a new class on every call.
MEGATRON_ROW = Row(
    "megatron-fsdp", (0, 6), (0, 7), True,
    "0.6.0 and 0.6.1 read: experimental/fully_shard.py's _attach_mixin builds "
    "type(f\"ExperimentalFsdp{module_cls.__name__}\", (FsdpModule, module_cls), {}) with the global type, "
    "no cache, and assigns __class__; 0.6.1 + torch 2.13.0 + transformers 4.55.2 run on the CPU (1-rank "
    "gloo, decoder layers then root): the root fails with the layout error unpatched and wraps "
    "patched; the forward needs CUDA; 0.5.0 has no experimental module and no class swap",
    f"0.6.0{_TO}0.6.1",
    "Megatron-FSDP's experimental `fully_shard` builds `ExperimentalFsdp<Name>` inline, a new class per "
    "call: patched (0.5.0 has no such site)",
)

DDP_ROW = Row(
    "torch", (2, 4), (2, 16), True,
    "2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.13.0 and 2.15.0 read: _composable/replicate.py's replicate() "
    "ends with type(f\"DDP{cls.__name__}\", (DDP, cls), dct) and module.__class__ = new_cls, no cache; "
    "2.4.1, 2.8.0, 2.10.0, 2.13.0 and 2.15.0 + transformers 4.55.2 run (verify, 2 gloo ranks): layout "
    "error, fixed, trains exactly",
    f"2.4{_TO}2.15",
    "composable DDP `replicate()` (`_composable/replicate.py`) builds `DDP<Name>` inline, a new class "
    "per call: patched",
)



@dataclass(frozen=True)
class ClassSwap:
    """A place in torch (or another package with a site) that assigns an object's ``__class__``,
    left alone, and why."""

    file: str  # relative to the package's directory
    function: str  # the enclosing function's qualified name, "<module>" at the top level, "*": any
    reason: str
    package: str = "torch"  # the top-level package the file is in


# Every __class__ assignment in the Python sources of torch 2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0,
# 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0, and of megatron-fsdp 0.5.0, 0.6.0 and
# 0.6.1, that is not one of _sites.SITES' builders (a sweep of each release's wheel, reading every
# assignment to ``X.__class__`` and every setattr of "__class__"); tests/test_sites.py reads the
# installed torch and megatron-fsdp and fails on one that is neither a site nor listed here.
OTHER_CLASS_SWAPS = (
    ClassSwap("nn/utils/parametrize.py", "_inject_new_class",
              "one base: Parametrized<Name>(cls,) keeps the original class's layout"),
    ClassSwap("nn/utils/parametrize.py", "remove_parametrizations", "back to the module's own class"),
    ClassSwap("nn/modules/lazy.py", "LazyModuleMixin._infer_parameters",
              "lazy modules become torch's own cls_to_become"),
    ClassSwap("nn/parameter.py", "UninitializedTensorMixin.materialize", "parameters, not modules"),
    ClassSwap("ao/nn/quantized/modules/activation.py", "MultiheadAttention.from_observed",
              "torch.ao quantization swaps between torch's own classes"),
    ClassSwap("ao/nn/quantized/modules/rnn.py", "LSTM.from_observed",
              "torch.ao quantization swaps between torch's own classes"),
    ClassSwap("fx/experimental/proxy_tensor.py", "_ModuleStackTracer.__init__.AttrProxy.__init__",
              "torch.fx's tracing proxies, not modules users shard or replicate"),
    ClassSwap("utils/_config_module.py", "install_config_module", "a Python module object, not an nn.Module"),
    ClassSwap("utils/deterministic.py", "<module>", "a Python module object, not an nn.Module"),
    ClassSwap("distributed/_spmd/config.py", "<module>", "a Python module object, not an nn.Module (2.4)"),
    ClassSwap("_vendor/quack/cache/__init__.py", "<module>",
              "a Python module object, not an nn.Module (2.13, 2.14)"),
    ClassSwap("_vendor/quack/pipeline.py", "*",
              "the vendored CUTLASS pipelines (2.13+) swap between their own kernel classes"),
    ClassSwap("experimental/fully_shard.py", "fully_shard",
              "back to the module's own class when FsdpModule.__init__ fails", "megatron_fsdp"),
)

# CPython decides the swap itself (compatible_for_assignment in Objects/typeobject.c); torch
# only builds the class it is asked to accept. The rows are about the ABC case the
# transformers heads hit; other empty-__slots__ parents are asked per class at run time.
PYTHON_ROWS = (
    Row("python", (0,), (3, 15), True,
        "CPython 3.9.18, 3.10.13, 3.11.7, 3.12.1, 3.13.0 and 3.14.10 run: layout_repro.py refuses "
        "the ABC, Generic[T] and collections.abc swaps alike (older Pythons are not supported)",
        f"3.9{_TO}3.14", "CPython refuses the swap when `ABC`, `Generic[T]` or a `collections.abc` "
        "class comes first: patched"),
    Row("python", (3, 15), None, False,
        "CPython 3.15.2 run: layout_repro.py's ABC swaps accepted; torch 2.15.0 + transformers "
        "4.55.2 shard and train the three heads unpatched; Generic[T]-first and Protocol-first "
        "classes still refused",
        "≥ 3.15", "CPython accepts the ABC swap, so the transformers heads need nothing: not "
        "patched; it still refuses `Generic[T]`- and `Protocol`-first classes, which "
        "`FSDP_AUTOPATCH=force` patches (CPython is asked per class)"),
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


def row_for(rows: tuple[Row, ...], version: str) -> Optional[Row]:
    numbers = release(version)
    return next((row for row in rows if row.covers(numbers)), None)


def first_release_after(rows: tuple[Row, ...]) -> Release:
    """The first release no row covers (the rows tile from 0 up to their last end)."""
    end = rows[-1].end
    if end is None:
        raise ValueError(f"the {rows[-1].package} rows have no upper end")
    return end


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
    decided_by: Optional[str] = None  # PROBE or MATRIX; None where no bug question was asked
    # Neither the probe nor the rows could tell whether the bug is here: worth a warning.
    cannot_tell: bool = False


# A probe answers "does CPython refuse the FSDP class this torch builds for an ABC module?" by
# trying it; None when it cannot tell.
Probe = Callable[[], Optional[bool]]


def decide(
    mode: str,
    torch_version: Optional[str],
    transformers_version: Optional[str],
    probe: Optional[Probe] = None,
    python: Optional[str] = None,
) -> Decision:
    """Should the patch be installed for this mode, these versions and this Python?

    ``python`` defaults to the running interpreter. The probe, when given and able to tell,
    decides; the rows decide otherwise.
    """
    if mode == _config.OFF:
        return Decision(False, f"disabled by {_config.MODE_VARIABLE}", None)
    if torch_version is None:
        return Decision(False, "torch is not installed: there is nothing to patch", None)
    torch_row = row_for(TORCH_ROWS, torch_version)
    if torch_row is not None and not torch_row.affected:
        return Decision(False, f"torch {torch_version} has no FSDP2 ({torch_row.evidence})", False,
                        MATRIX)
    if mode == _config.FORCE:
        return Decision(True, f"{_config.MODE_VARIABLE}=force: patching torch {torch_version} "
                              "whatever the matrix says; each class is still asked of CPython", None)
    if transformers_version is None:
        return Decision(False, f"transformers is not installed, and only its {AFFECTED_TRANSFORMERS} "
                               f"heads need the patch (set {_config.MODE_VARIABLE}=force for "
                               "your own ABC modules)", None)
    transformers_row = row_for(TRANSFORMERS_ROWS, transformers_version)
    assert transformers_row is not None  # the rows cover every release
    if not transformers_row.affected:
        return Decision(False, f"transformers {transformers_version} is not affected "
                               f"({transformers_row.evidence}); set {_config.MODE_VARIABLE}=force "
                               "for your own ABC modules", False, MATRIX)
    pair = f"torch {torch_version} with transformers {transformers_version}"
    python_row = row_for(PYTHON_ROWS, python or python_version())
    assert python_row is not None  # the rows cover every release
    cpython = interpreter(python)
    in_matrix = (False if not python_row.affected
                 else None if torch_row is None else True)
    refused = probe() if probe is not None else None
    if refused is True:
        return Decision(True, f"{pair} has the bug: {cpython} refuses torch {torch_version}'s wrapper "
                              "classes for ABC modules (probed)", in_matrix, PROBE)
    if refused is False:
        return Decision(False, f"{cpython} accepts torch {torch_version}'s wrapper classes for "
                               "ABC modules (probed): nothing to patch", in_matrix, PROBE)
    if in_matrix is True:
        assert torch_row is not None
        return Decision(True, f"{pair} has the bug on {cpython} (version matrix: "
                              f"{torch_row.evidence})", True, MATRIX)
    if in_matrix is False:
        # The row's range, not its evidence: the evidence names the CPython it was measured on,
        # often the very one running, which the reason already names.
        return Decision(False, f"{cpython} accepts torch's wrapper classes for ABC modules, as the "
                               f"version matrix has it for CPython {python_row.versions}: nothing to "
                               f"patch (set {_config.MODE_VARIABLE}=force for your own modules whose "
                               "swap it still refuses)", False, MATRIX)
    return Decision(False, f"torch {torch_version} is newer than the matrix and its class "
                           "construction could not be probed; set "
                           f"{_config.MODE_VARIABLE}=force to patch anyway", None, MATRIX,
                    cannot_tell=True)


def _release_text(numbers: Release) -> str:
    return ".".join(map(str, numbers))


def render_version_table() -> str:
    """The table of docs/versions.md (between ``<!-- versions:start -->`` and ``-->end``), from the rows."""
    newer = _release_text(first_release_after(TORCH_ROWS))
    lines = ["| package | versions | fact |", "| --- | --- | --- |"]
    lines += [f"| transformers | {row.versions} | {row.fact} |" for row in TRANSFORMERS_ROWS]
    lines += [f"| torch | {row.versions} | {row.fact} |" for row in TORCH_ROWS]
    lines.append(f"| torch | ≥ {newer} | not in the rows: only the probe can say; without one, "
                 f"not patched (`{_config.MODE_VARIABLE}=force` patches anyway) |")
    lines += [f"| torch | {row.versions} | {row.fact} |" for row in (REPLICATE_ROW, DDP_ROW)]
    lines.append(f"| megatron-fsdp | {MEGATRON_ROW.versions} | {MEGATRON_ROW.fact} |")
    lines += [f"| Python | {row.versions} | {row.fact} |" for row in PYTHON_ROWS]
    lines += ["", f"Every other `__class__` assignment in torch 2.4{_TO}2.15 and megatron-fsdp "
              f"0.6.0{_TO}0.6.1, left alone:", "",
              "| package | file | function | why |", "| --- | --- | --- | --- |"]
    lines += [f"| {swap.package} | `{swap.file}` | `{swap.function}` | {swap.reason} |"
              for swap in OTHER_CLASS_SWAPS]
    return "\n".join(lines) + "\n"
