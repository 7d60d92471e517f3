"""Three made-up torch releases, each added as CONTRIBUTING's recipe adds a release: rows alone.
They are numbered 99.1 to 99.3 and name a made-up API, so that a real release added by the recipe
never clashes with them.

- 99.1 moves the helper that FSDP2's ``fully_shard`` and ``replicate`` share out of
  ``_fsdp_init`` into a new module, with parameters of its own: one ``Site`` row per API that
  calls it.
- 99.2 adds an API in a new module, ``torch.distributed._composable.made_up_wrap``, which swaps a
  module's class the same way: its label in ``APIS``, its ``Site`` row, its module watched.
- 99.3 fixes the bug at every site (``upstream/torch.diff``'s ``make_wrapper_cls``, called by
  every builder): a row with torch's fix for each API whose builder has none yet (composable
  DDP's, which did not move, has one since 2.13), and its torch row ``fixed``.

Each builds on the one before, as releases do, and adds its ``_torch`` row. What torch itself
would ship is in ``tests/stand_in/made_up/<release>/``: the modules that release changes, laid
over the stand-in torch (``lay_over``). ``add_rows`` puts a release's rows, and those of the
releases before it, into the package's tables (and the docs' record) as the recipe's edits have
them; ``add_rows_at_start`` does it from a ``.pth`` file, before the package arms, as if the rows
were in its source. tests/test_sites.py runs each release on the stand-in (``made_up_run.py``);
the tests that read the tables read them with each release's rows too (``TABLES``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import fsdp_autopatch
from fsdp_autopatch import FSDP2_PACKAGES, FULLY_SHARD_MODULES, REPLICATE_WITH_FSDP_MODULE, _matrix, _sites
from fsdp_autopatch._sites import FSDP2_REPLICATE, FULLY_SHARD, Site

MADE_UP = Path(__file__).resolve().parent.parent / "stand_in" / "made_up"

# The recipe's edit to fsdp_autopatch/__init__.py: the new API's module, which users import it from.
MADE_UP_WRAP_MODULE = "torch.distributed._composable.made_up_wrap"
# The recipe's edits to fsdp_autopatch/_sites.py: the new API's label, and where 99.1 moved the
# helper, its parameters named in the order of _sites.HELPER_ROLES.
MADE_UP_WRAP = "made-up wrap"
_SWAP_CLASS = ("torch.distributed._composable._swap_class", "_apply_to_module",
               ("modules", "cache", "wrapper_cls", "prefix", "deepcopy_fn"))
_FULLY_SHARD_2_6, _ = FULLY_SHARD_MODULES
_FSDP_2_6, _ = FSDP2_PACKAGES
_TORCH_FIX = _sites._TORCH_FIX


def made_up_row(minor: int, evidence: str, fixed: bool = False) -> _matrix.TorchRow:
    """A made-up release's torch row, as ``_matrix._torch`` writes one for 2.<minor>: numbered 99.<minor>
    so that it never stands in the way of a real release's row."""
    return _matrix.TorchRow("torch", (99, minor), (99, minor + 1), evidence, fixed=fixed)


@dataclass(frozen=True)
class MadeUpRelease:
    """One made-up torch release: the rows the recipe adds for it, and the release before it."""

    torch: str  # its version
    sites: tuple[Site, ...]  # its Site rows
    row: _matrix.TorchRow  # its _torch row
    previous: Optional[MadeUpRelease] = None
    apis: tuple[str, ...] = ()  # the labels it adds to _sites.APIS
    torch_modules: tuple[str, ...] = ()  # the modules it adds to TORCH_MODULES
    evidence: tuple[tuple[str, str, str], ...] = ()  # its new APIs' version_table.SiteEvidence

    def __str__(self) -> str:
        return f"made-up torch {self.torch}"


MOVES_THE_SHARED_HELPER = MadeUpRelease(
    "99.1.0",
    (Site(FULLY_SHARD, (99, 1), _FULLY_SHARD_2_6, "fully_shard", ("FSDPModule",), "FSDP",
          "_unimplemented_deepcopy", "cls_to_fsdp_cls", _SWAP_CLASS, _FSDP_2_6),
     Site(FSDP2_REPLICATE, (99, 1), REPLICATE_WITH_FSDP_MODULE, "replicate",
          ("ReplicateModule", "FSDPModule"), "Replicate", "_unimplemented_deepcopy", "cls_to_replicate_cls",
          _SWAP_CLASS)),
    made_up_row(1, "99.1.0 (made up) read: _apply_to_module moved to _composable/_swap_class.py, "
                   "called by fully_shard and FSDP2 replicate; _fsdp_init keeps the old one"),
)
ADDS_AN_API = MadeUpRelease(
    "99.2.0",
    (Site(MADE_UP_WRAP, (99, 2), MADE_UP_WRAP_MODULE, "made_up_wrap", ("MadeUpModule",), "MadeUp",
          "_unimplemented_deepcopy", "cls_to_made_up_cls"),),
    made_up_row(2, "99.2.0 (made up) read: as 99.1.0; _composable/made_up_wrap.py builds "
                   "MadeUp<Name>(MadeUpModule, cls) inline with cls_to_made_up_cls"),
    MOVES_THE_SHARED_HELPER,
    apis=(MADE_UP_WRAP,),
    torch_modules=(MADE_UP_WRAP_MODULE,),
    evidence=((MADE_UP_WRAP, "torch 99.2 (made up)", "99.2.0 read: made_up_wrap builds its class inline"),),
)
# Composable DDP needs no row: its builder has not moved, and its row with torch's fix (since 2.13)
# already matches the 99.3 stand-in.
FIXES_THE_BUG = MadeUpRelease(
    "99.3.0",
    (Site(FULLY_SHARD, (99, 3), _FULLY_SHARD_2_6, "fully_shard", ("FSDPModule",), "FSDP",
          "_unimplemented_deepcopy", "cls_to_fsdp_cls", _SWAP_CLASS, _FSDP_2_6, torch_fix=_TORCH_FIX),
     Site(FSDP2_REPLICATE, (99, 3), REPLICATE_WITH_FSDP_MODULE, "replicate",
          ("ReplicateModule", "FSDPModule"), "Replicate", "_unimplemented_deepcopy", "cls_to_replicate_cls",
          _SWAP_CLASS, torch_fix=_TORCH_FIX),
     Site(MADE_UP_WRAP, (99, 3), MADE_UP_WRAP_MODULE, "made_up_wrap", ("MadeUpModule",), "MadeUp",
          "_unimplemented_deepcopy", "cls_to_made_up_cls", torch_fix=_TORCH_FIX)),
    made_up_row(3, "99.3.0 (made up) read: every builder calls torch.distributed._wrapper_cls."
                   "make_wrapper_cls (upstream/torch.diff) in place of type", fixed=True),
    ADDS_AN_API,
)
RELEASES = (MOVES_THE_SHARED_HELPER, ADDS_AN_API, FIXES_THE_BUG)
# For the tests that read the tables: the tables as shipped (None), and with each release's rows.
TABLES: tuple[Optional[MadeUpRelease], ...] = (None, *RELEASES)


def table_id(release: Optional[MadeUpRelease]) -> str:
    return "as shipped" if release is None else str(release)


def named(version: str) -> MadeUpRelease:
    return next(release for release in RELEASES if release.torch == version)


def add_rows(release: Optional[MadeUpRelease], set_attr: Callable[[Any, str, Any], None] = setattr,
             record: Optional[ModuleType] = None) -> None:
    """Put ``release``'s rows, and those of the releases before it, into the package's tables
    (``set_attr``: ``monkeypatch.setattr`` in a test) and into ``record`` (tests/version_table.py),
    where the recipe's edits put them."""
    if release is None:
        return
    add_rows(release.previous, set_attr, record)
    # As fsdp_autopatch/__init__.py builds them, and _sites takes them from there.
    torch_modules = (*fsdp_autopatch.TORCH_MODULES, *release.torch_modules)
    for module in (fsdp_autopatch, _sites):
        set_attr(module, "TORCH_MODULES", torch_modules)
        set_attr(module, "WATCHED_MODULES", (*torch_modules, fsdp_autopatch.MEGATRON_FSDP_MODULE))
    apis = (*_sites.APIS, *release.apis)
    set_attr(_sites, "APIS", apis)
    # In the table's order: per API (in the order of APIS), newest first, torch's fix first.
    set_attr(_sites, "SITES", tuple(sorted((*_sites.SITES, *release.sites), key=lambda site: (
        apis.index(site.api), tuple(-number for number in site.since), not site.fixed))))
    set_attr(_matrix, "TORCH_ROWS", (*_matrix.TORCH_ROWS, release.row))
    if record is not None:
        added = (record.SiteEvidence(*evidence) for evidence in release.evidence)
        set_attr(record, "SITE_EVIDENCE", (*record.SITE_EVIDENCE, *added))


def add_rows_at_start(version: str) -> None:
    """From a ``.pth`` line read before the package's own: the rows of the release the stand-in
    torch is, in the tables before the package arms, as if they were in its source. Once: the
    site module may read a venv's ``.pth`` files twice (CPython 3.11 adds site-packages both in
    ``site.venv`` and after it), as ``arm`` knows."""
    release = named(version)
    if release.row not in _matrix.TORCH_ROWS:
        add_rows(release)


def lay_over(site_packages: Path, release: MadeUpRelease) -> None:
    """Make the stand-in torch in ``site_packages`` that release: the modules each release up to
    it changes, oldest first; where it has torch's fix, the module upstream/torch.diff adds,
    which is the package's own ``_wrapper_cls.py``, character for character."""
    for each in releases_up_to(release):
        shutil.copytree(MADE_UP / each.torch, site_packages, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    if release.row.fixed:
        fix_module = Path(*_TORCH_FIX[0].split(".")).with_suffix(".py")
        shutil.copy2(site_packages / "fsdp_autopatch" / "_wrapper_cls.py", site_packages / fix_module)


def releases_up_to(release: MadeUpRelease) -> list[MadeUpRelease]:
    return [*(releases_up_to(release.previous) if release.previous else []), release]
