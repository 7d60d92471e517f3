"""The table of docs/versions.md, written from the package's rows: nothing here ships in the wheel.

    python tests/version_table.py            # print the table
    python tests/version_table.py --update   # write it between docs/versions.md's markers

Run from a checkout, it reads the checkout's package (never an installed copy), with any Python.

The rows the package decides from (``fsdp_autopatch._matrix``) carry their evidence; what only the
record needs lives here: per class-construction site of ``fsdp_autopatch._sites``, the releases
that have it and what was read or run of them, and every other ``__class__`` assignment in torch
and megatron-fsdp with the reason it is left alone (``tests/test_sites.py`` sweeps the installed
ones against this list). ``tests/test_matrix.py`` fails until docs/versions.md shows this table.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # as printed: the checkout's package, whatever this Python has installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    # An installed package's start-up file has imported its own fsdp_autopatch already: forget it,
    # so that the modules below are the checkout's.
    for _name in [name for name in sys.modules if name.split(".")[0] == "fsdp_autopatch"]:
        del sys.modules[_name]

from fsdp_autopatch import _matrix, _sites

TO = " \N{EN DASH} "  # the docs' way of writing a range of releases
DOCS = Path(__file__).resolve().parent.parent / "docs" / "versions.md"
MARKERS = re.compile(r"(<!-- versions:start -->\n)(.*?)(<!-- versions:end -->)", re.S)


def first_release_after(rows: tuple[_matrix.Row, ...]) -> _matrix.Release:
    """The first release no row covers (the rows tile from 0 up to their last end)."""
    end = rows[-1].end
    if end is None:
        raise ValueError(f"the {rows[-1].package} rows have no upper end")
    return end


@dataclass(frozen=True)
class SiteEvidence:
    """Which releases of its distribution have an API's class construction, and what was read."""

    api: str
    releases: str
    evidence: str


SITE_EVIDENCE = (
    SiteEvidence(_sites.FULLY_SHARD, f"torch 2.4{TO}2.15", "see the torch rows above"),
    SiteEvidence(_sites.FSDP2_REPLICATE, f"torch 2.9{TO}2.15",
                 "2.9.1 and 2.10.0 read: replicate_with_fsdp.replicate_impl builds Replicate<Name> inline "
                 "((FSDPModule, cls) in 2.9.1, (ReplicateModule, cls) in 2.10.0) with cls_to_replicate_cls; "
                 f"2.11.0{TO}2.15.0 read: passed to _fsdp_init._apply_to_module like fully_shard's; 2.10.0 "
                 f"and 2.13.0 + transformers 4.55.2 run: layout error, fixed; 2.4.1{TO}2.8.0 have no "
                 "replicate_with_fsdp"),
    SiteEvidence(_sites.DDP_REPLICATE, f"torch 2.4{TO}2.15",
                 "2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.13.0 and 2.15.0 read: _composable/replicate.py's "
                 "replicate() ends with type(f\"DDP{cls.__name__}\", (DDP, cls), dct) and module.__class__ "
                 "= new_cls, no cache; 2.4.1, 2.8.0, 2.10.0, 2.13.0 and 2.15.0 + transformers 4.55.2 run: "
                 "layout error, fixed, trains exactly"),
    SiteEvidence(_sites.MEGATRON_FULLY_SHARD, f"megatron-fsdp 0.6.0{TO}0.6.1",
                 "0.6.0 and 0.6.1 read: experimental/fully_shard.py's _attach_mixin builds "
                 "type(f\"ExperimentalFsdp{module_cls.__name__}\", (FsdpModule, module_cls), {}), no cache; "
                 "0.6.1 + torch 2.13.0 + transformers 4.55.2 run on the CPU: layout error unpatched, wraps "
                 "patched (the forward needs CUDA); 0.5.0 has no such module"),
)


@dataclass(frozen=True)
class ClassSwap:
    """A place in torch (or another package with a site) that assigns an object's ``__class__``,
    left alone, and why."""

    file: str  # relative to the package's directory
    function: str  # the enclosing function's qualified name, "<module>" at the top level, "*": any
    reason: str
    package: str = "torch"  # the top-level package the file is in


# The releases whose wheels were swept: every assignment to ``X.__class__`` and every setattr of
# "__class__" in their Python sources read. A release added to the rows joins this list only once
# its wheel is swept; the page says which rows have no sweep.
SWEPT = {
    "torch": ("2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0",
              "2.14.1", "2.15.0"),
    "megatron-fsdp": ("0.5.0", "0.6.0", "0.6.1"),
}
# Every __class__ assignment in the swept releases that is not one of _sites.SITES' builders.
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


def release_text(numbers: _matrix.Release) -> str:
    return ".".join(map(str, numbers))


def versions(row: _matrix.Row) -> str:
    """How the table writes a row's releases."""
    if row.first == (0,):
        return f"< {release_text(row.end)}" if row.end else "all"
    if row.end is None:
        return f"≥ {release_text(row.first)}"
    if row.package == "torch" and row.end == (*row.first[:-1], row.first[-1] + 1):
        return release_text(row.first)  # one release
    last = release_text(row.last) if row.last else f"< {release_text(row.end)}"
    return f"{release_text(row.first)}{TO}{last}"


def bug(row: _matrix.Row) -> str:
    """How the table answers "is the bug here?" for a row: a torch with FSDP2 (and no fix of its
    own), a transformers with ABC heads, a CPython that refuses the ABC swap."""
    if isinstance(row, _matrix.TorchRow):
        return "no: torch's fix" if row.fixed else "yes" if row.has_fsdp2 else "no"
    if isinstance(row, _matrix.TransformersRow):
        return "yes" if row.abc_heads else "no"
    assert isinstance(row, _matrix.PythonRow)
    return "yes" if row.refuses_abc_swap else "no"


def render() -> str:
    """The table between docs/versions.md's ``<!-- versions:start -->`` and ``-->end`` markers."""
    newer = release_text(first_release_after(_matrix.TORCH_ROWS))
    rows = (*_matrix.TRANSFORMERS_ROWS, *_matrix.TORCH_ROWS)
    lines = ["| package | versions | bug | evidence |", "| --- | --- | --- | --- |"]
    lines += [f"| {row.package} | {versions(row)} | {bug(row)} | {row.evidence} |" for row in rows]
    lines.append(f"| torch | ≥ {newer} | ? | not in the rows: the probe decides at import; where it cannot "
                 "run, not patched (`FSDP_AUTOPATCH=force` patches anyway) |")
    lines += [f"| Python | {versions(row)} | {bug(row)} | {row.evidence} |" for row in _matrix.PYTHON_ROWS]
    lines += ["", "Where each wrapper builds its classes (`fsdp_autopatch/_sites.py`, one row per way):", "",
              "| wrapper | releases | evidence |", "| --- | --- | --- |"]
    lines += [f"| {site.api} | {site.releases} | {site.evidence} |" for site in SITE_EVIDENCE]
    lines += ["", "The rows, each named as `doctor --json` names it (`site_key`), newest first per wrapper:",
              "", "| row | the function users call | the class is built in |", "| --- | --- | --- |"]
    for site in _sites.SITES:
        by = f", by `{'.'.join(site.torch_fix)}`" if site.torch_fix else ""
        lines.append(f"| {site.key} | `{site.name}` | `{site.builder_module}.{site.builder}`{by} |")
    fixes = sorted({".".join(site.torch_fix) for site in _sites.SITES if site.torch_fix})
    fixed_apis = ", ".join(api for api in _sites.APIS if any(site.fixed for site in _sites.sites_of(api)))
    fixed = [release_text(row.first) for row in _matrix.TORCH_ROWS if row.fixed]
    released = f"first released in torch {fixed[0]}" if fixed else "in no release yet"
    lines += ["", f"torch's own fix ([upstream/torch.diff](../upstream/README.md), {released}): the "
              f"builders of {fixed_apis} call `{', '.join(fixes)}` (this package's "
              "`fsdp_autopatch/_wrapper_cls.py`) in place of `type`; it builds a class CPython accepts. "
              "Where a torch has it, the probe finds no bug at any site and the package stands aside."]
    swept = "; ".join(f"{package} {', '.join(releases)}" for package, releases in SWEPT.items())
    newest_swept = _matrix.release(SWEPT["torch"][-1])[:2]
    unswept = [release_text(row.first) for row in _matrix.TORCH_ROWS if row.first[:2] > newest_swept]
    if unswept:
        lines += ["", f"No sweep of every `__class__` assignment yet for torch {', '.join(unswept)}: "
                  "its row is all that was read or run of it."]
    lines += ["", f"Every other `__class__` assignment in the releases swept ({swept}), left alone:", "",
              "| package | file | function | why |", "| --- | --- | --- | --- |"]
    lines += [f"| {swap.package} | `{swap.file}` | `{swap.function}` | {swap.reason} |"
              for swap in OTHER_CLASS_SWAPS]
    return "\n".join(lines) + "\n"


def documented() -> str:
    """The table docs/versions.md shows now."""
    match = MARKERS.search(DOCS.read_text(encoding="utf-8"))
    assert match is not None, f"{DOCS} has no <!-- versions:start --> ... <!-- versions:end -->"
    return match.group(2)


def main(argv: list[str]) -> int:
    if argv == ["--update"]:
        page = DOCS.read_text(encoding="utf-8")
        DOCS.write_text(MARKERS.sub(lambda match: match.group(1) + render() + match.group(3), page),
                        encoding="utf-8")
        return 0
    print(render(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
