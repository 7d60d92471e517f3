"""doctor's answer about torch's class-construction sites: torch's source files compiled, never
imported, and read with the same bytecode check the patch makes on the live modules
(``_sites.shape_problem``): the builder must call the global ``type`` by name, and an entry that
is not its own builder must call the builder by name. Fake torch source trees show each way a
torch release could move away from that; the real torch's files, copied and edited, show the same.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional

import made_up_releases
import pytest
from conftest import STAND_IN, environment, make_throwaway, run_python
from test_cli import add_distribution, one_object, run_cli

from fsdp_autopatch import _doctor, _matrix, _sites
from fsdp_autopatch._console import installed_version

PROOF = "Proof: fsdp-autopatch verify"
SITE_2_6 = "torch/distributed/fsdp/_fully_shard/_fully_shard.py"
HELPER = "torch/distributed/fsdp/_fully_shard/_fsdp_init.py"
SITE_2_4 = "torch/distributed/_composable/fsdp/fully_shard.py"
DDP = "torch/distributed/_composable/replicate.py"
REPLICATE = "torch/distributed/_composable/replicate_with_fsdp.py"
FULLY_SHARD_2_6 = "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard"

# The shape of torch 2.11 - 2.15's torch/distributed/fsdp/_fully_shard/_fully_shard.py, cut down.
TORCH_2_13 = '''
from __future__ import annotations

from typing import Any, overload

from torch.distributed._composable import contract

from ._fsdp_init import _apply_to_module

cls_to_fsdp_cls: dict[type, type] = {}


def get_cls_to_fsdp_cls() -> dict[type, type]:
    return cls_to_fsdp_cls


@overload
def fully_shard(module: int, *, mesh: Any = ...) -> int: ...


@contract(state_cls=object)
def fully_shard(module, *, mesh=None):
    modules = (module,)
    _apply_to_module(modules, cls_to_fsdp_cls, FSDPModule, "FSDP", _unimplemented_deepcopy)
    return module


def _unimplemented_deepcopy(*args: Any, **kwargs: Any):
    raise AssertionError("FSDP does not support deepcopy")


class FSDPModule:
    pass
'''
APPLY_CALL = "_apply_to_module(modules, cls_to_fsdp_cls, FSDPModule"

# torch 2.11 - 2.15's _fsdp_init._apply_to_module, as the stand-in torch has it.
TORCH_2_13_HELPER = (STAND_IN / HELPER).read_text(encoding="utf-8")
TORCH_2_13_FILES = {SITE_2_6: TORCH_2_13, HELPER: TORCH_2_13_HELPER}

# torch 2.4's torch/distributed/_composable/fsdp/fully_shard.py: the class built inline, no cache.
TORCH_2_4 = '''
def fully_shard(module, *, mesh=None):
    cls = module.__class__
    dct = {"__deepcopy__": unimplemented_deepcopy}
    new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), dct)
    module.__class__ = new_cls
    return module


def unimplemented_deepcopy(*args, **kwargs):
    raise AssertionError("FSDP does not support deepcopy")


class FSDPModule:
    pass
'''

# Composable DDP's torch/distributed/_composable/replicate.py (2.4 - 2.15), as the stand-in has it.
TORCH_DDP = (STAND_IN / DDP).read_text(encoding="utf-8")

# FSDP2's torch/distributed/_composable/replicate_with_fsdp.py (2.11 - 2.15), cut down.
TORCH_REPLICATE = '''
from torch.distributed.fsdp._fully_shard._fsdp_init import _apply_to_module

cls_to_replicate_cls = {}


def _unimplemented_deepcopy(*args, **kwargs):
    raise AssertionError("FSDP does not support deepcopy")


class FSDPModule:
    pass


class ReplicateModule(FSDPModule):
    pass


def replicate(module, mesh=None):
    _apply_to_module((module,), cls_to_replicate_cls, ReplicateModule, "Replicate", _unimplemented_deepcopy)
    return module
'''
# Every site of torch 2.13, cut down.
TORCH_2_13_EVERY_SITE = {**TORCH_2_13_FILES, DDP: TORCH_DDP, REPLICATE: TORCH_REPLICATE}


def edited(source: str, old: str, new: str, count: int = -1) -> str:
    """``source`` with ``old`` replaced; fails when ``old`` is not there (an edit that changes
    nothing would prove nothing)."""
    assert old in source, f"{old!r} is not in the source"
    return source.replace(old, new, count)


def torch_tree(root: Path, files: dict[str, str]) -> Path:
    """A torch package under ``root``: every directory a package, these files in it."""
    (root / "torch").mkdir(parents=True, exist_ok=True)
    (root / "torch" / "__init__.py").write_text('__version__ = "2.13.0"\n')
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = path.parent
        while folder != root:
            (folder / "__init__.py").touch()
            folder = folder.parent
        path.write_text(textwrap.dedent(source))
    return root


class Answer:
    """doctor's answer for one API, read as attributes."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.__dict__.update(answer)


def read_from(search: Path, version: str) -> list[Answer]:
    """doctor's answers with ``search`` as the only place packages are found."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "path", [str(search)])
        patch.setattr(sys, "path_importer_cache", {})
        return [Answer(_doctor.find_site(api, version)) for api in _sites.APIS]


def layout(tmp_path: Path, files: dict[str, str], version: str = "2.13.0", api: str = _sites.FULLY_SHARD
           ) -> Answer:
    answers = read_from(torch_tree(tmp_path, files), version)
    assert [answer.api for answer in answers] == list(_sites.APIS)
    return next(answer for answer in answers if answer.api == api)


# --------------------------------------------------------------------------------------------- known layouts


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_torch_2_13s_layout_is_known_with_the_function_and_the_wrapper_named(
    tmp_path: Path, release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    made_up_releases.add_rows(release, monkeypatch.setattr)
    answer = layout(tmp_path, TORCH_2_13_FILES)
    assert answer.known is True and answer.site_key == "FSDP2 fully_shard since torch 2.11"
    assert answer.site == FULLY_SHARD_2_6 and answer.file == str(tmp_path / SITE_2_6)
    assert answer.text == "FSDP2 fully_shard site known: _fsdp_init._apply_to_module"


@pytest.mark.parametrize("version", ["2.13.0", "99.1.0"])
def test_a_newer_rows_helper_beside_the_one_the_wrappers_call_is_not_their_site(
    tmp_path: Path, version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.13's files holding made-up 99.1's helper module too (the same name in a new place),
    with 99.1's rows in the tables: fully_shard still calls _fsdp_init's, so doctor names the 2.11
    row. At 2.13.0 by release; at a 99.1.0 that did not move it, by where its helper comes from."""
    release = made_up_releases.MOVES_THE_SHARED_HELPER
    made_up_releases.add_rows(release, monkeypatch.setattr)
    moved = "torch/distributed/_composable/_swap_class.py"
    files = {**TORCH_2_13_FILES, moved: (made_up_releases.MADE_UP / release.torch / moved).read_text()}
    answer = layout(tmp_path, files, version)
    assert (answer.known, answer.site_key) == (True, "FSDP2 fully_shard since torch 2.11")


@pytest.mark.parametrize("release", made_up_releases.RELEASES, ids=made_up_releases.table_id)
def test_a_newer_releases_rows_are_not_asked_of_an_older_torch(
    tmp_path: Path, release: made_up_releases.MadeUpRelease, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.13's files, with a newer release's rows in the tables: each wrapper is known by a row
    2.13 may have, and one 2.13 predates is absent, not a layout doctor does not know (which would
    turn OK into CANNOT TELL where the stand-in lacks the new module)."""
    made_up_releases.add_rows(release, monkeypatch.setattr)
    for answer in read_from(torch_tree(tmp_path, TORCH_2_13_EVERY_SITE), "2.13.0"):
        rows = _sites.sites_of(answer.api, (2, 13))
        if _sites.distribution_of(answer.api) != "torch":
            continue
        if rows:
            assert answer.known is True and answer.site_key in {site.key for site in rows}, answer.text
        else:
            assert (answer.known, answer.text) == (None, f"torch 2.13.0 has no {answer.api}")


def test_a_module_binds_what_it_imports_from_the_module_the_import_names(tmp_path: Path) -> None:
    source = textwrap.dedent("""
        from __future__ import annotations
        import torch.nn as nn
        from ._fsdp_init import _apply_to_module, other as alias
        from .. import sibling
        from torch.distributed.fsdp._fully_shard._fsdp_init import helper
        try:
            from a import either
        except ImportError:
            from b import either
        @decorate()
        def fully_shard(module): ...
        class FSDPModule: ...
        count = 1
    """)
    path = tmp_path / "_fully_shard.py"
    path.write_text(source)
    origins = _doctor.compile_module(path, "torch.distributed.fsdp._fully_shard._fully_shard").origins
    assert origins == {
        "annotations": "__future__", "nn": "torch.nn",
        "_apply_to_module": "torch.distributed.fsdp._fully_shard._fsdp_init",
        "alias": "torch.distributed.fsdp._fully_shard._fsdp_init", "sibling": "torch.distributed.fsdp",
        "helper": "torch.distributed.fsdp._fully_shard._fsdp_init", "either": None,
        "fully_shard": "torch.distributed.fsdp._fully_shard._fully_shard",
        "FSDPModule": "torch.distributed.fsdp._fully_shard._fully_shard", "count": None}
    # A package's own __init__.py imports relative to itself.
    init = tmp_path / "__init__.py"
    init.write_text("from ._fully_shard import fully_shard\n")
    assert _doctor.compile_module(init, "torch.distributed.fsdp").origins == {
        "fully_shard": "torch.distributed.fsdp._fully_shard"}


def test_a_type_call_in_a_closure_counts(tmp_path: Path) -> None:
    closure = edited(edited(TORCH_2_13_HELPER, "new_cls = type(", "new_cls = (lambda: type("),
                     "(wrapper_module_cls, cls), dct)", "(wrapper_module_cls, cls), dct))()")
    assert layout(tmp_path, {SITE_2_6: TORCH_2_13, HELPER: closure}).known is True


def test_torch_2_4s_inline_construction_is_known_by_its_type_call(tmp_path: Path) -> None:
    answer = layout(tmp_path, {SITE_2_4: TORCH_2_4}, version="2.4.1")
    assert (answer.known, answer.site) == (True, "torch.distributed._composable.fsdp.fully_shard.fully_shard")
    assert answer.text == "FSDP2 fully_shard site known: fully_shard.fully_shard"


def test_composable_ddp_is_known_and_fsdp2_replicate_absent_before_2_9(tmp_path: Path) -> None:
    files = {**TORCH_2_13_FILES, DDP: TORCH_DDP}
    ddp = layout(tmp_path, files, api=_sites.DDP_REPLICATE)
    assert (ddp.known, ddp.text) == (True, "composable DDP replicate site known: replicate.replicate")
    assert ddp.site == "torch.distributed._composable.replicate.replicate"
    replicate = layout(tmp_path, files, version="2.8.0", api=_sites.FSDP2_REPLICATE)
    assert replicate.known is None and replicate.text == "torch 2.8.0 has no FSDP2 replicate"
    # From 2.9 on, a torch without it has moved it: a layout doctor does not know.
    moved = layout(tmp_path, files, api=_sites.FSDP2_REPLICATE)
    assert moved.known is False and moved.text.startswith("torch 2.13.0's FSDP2 replicate layout is unknown")
    known = layout(tmp_path, {**files, REPLICATE: TORCH_REPLICATE}, api=_sites.FSDP2_REPLICATE)
    assert (known.known, known.text) == (True, "FSDP2 replicate site known: _fsdp_init._apply_to_module")


# ------------------------------------------------------------------------------------------- unknown layouts


@pytest.mark.parametrize("case, files, why", [
    ("helper renamed", {SITE_2_6: TORCH_2_13.replace("_apply_to_module", "_wrap_modules"),
                        HELPER: TORCH_2_13_HELPER},
     "no _apply_to_module"),
    ("helper calls type as an attribute", {SITE_2_6: TORCH_2_13, HELPER: edited(
        TORCH_2_13_HELPER, "new_cls = type(", "new_cls = builtins.type(")},
     "_apply_to_module does not call the global type"),
    ("a parameter named type", {SITE_2_6: TORCH_2_13, HELPER: edited(
        TORCH_2_13_HELPER, "unimplemented_deepcopy: Callable[..., Any],",
        "unimplemented_deepcopy: Callable[..., Any], type: type = type,")},
     "_apply_to_module does not call the global type"),
    ("no fully_shard", {SITE_2_6: edited(TORCH_2_13, "def fully_shard(", "def shard("),
                        HELPER: TORCH_2_13_HELPER},
     "no fully_shard"),
    ("no deep-copy stub", {SITE_2_6: edited(TORCH_2_13, "def _unimplemented_deepcopy", "def _no_deepcopy"),
                           HELPER: TORCH_2_13_HELPER},
     "no _unimplemented_deepcopy"),
])
def test_a_layout_that_moved_away_is_unknown_not_ok(
    tmp_path: Path, case: str, files: dict[str, str], why: str
) -> None:
    answer = layout(tmp_path, files)
    assert answer.known is False, case
    assert answer.text.startswith("torch 2.13.0's FSDP2 layout is unknown to fsdp-autopatch ")
    assert f"{tmp_path / SITE_2_6}: " in answer.text and why in answer.text, answer.text


def test_an_inline_type_that_is_not_the_modules_global_is_unknown(tmp_path: Path) -> None:
    local = edited(TORCH_2_4, "def fully_shard(module, *, mesh=None):",
                   "def fully_shard(module, *, mesh=None, type=type):")
    answer = layout(tmp_path, {SITE_2_4: local}, version="2.4.1")
    assert answer.known is False
    assert f"{tmp_path / SITE_2_4}: fully_shard does not call the global type" in answer.text


def test_a_re_exporting_shim_is_not_a_site(tmp_path: Path) -> None:
    # torch 2.6+ keeps the 2.4 module as a shim importing fully_shard from its new home.
    shim = "from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401\n"
    renamed = TORCH_2_13.replace("_apply_to_module", "_wrap_modules")
    answer = layout(tmp_path, {SITE_2_6: renamed, HELPER: TORCH_2_13_HELPER, SITE_2_4: shim})
    assert answer.known is False
    assert f"{tmp_path / SITE_2_6}: no _apply_to_module" in answer.text
    assert f"{tmp_path / SITE_2_4}: no unimplemented_deepcopy" in answer.text


def test_a_torch_without_fsdp2_files_is_unknown(tmp_path: Path) -> None:
    answer = layout(tmp_path, {})
    assert answer.known is False
    assert answer.text.endswith("layout is unknown to fsdp-autopatch 0.2.0: none of the modules where it "
                                "looks is there")


@pytest.mark.parametrize("files, version, expected", [
    ({SITE_2_6: "def fully_shard(:\n"}, "2.13.0", "cannot tell: {}/" + SITE_2_6 + " cannot be compiled here"),
    (None, "2.13.0", "cannot tell: no torch package with source files is importable"),
    ({}, "2.3.1", "torch 2.3.1 has no FSDP2"),
])
def test_what_files_cannot_answer_is_cannot_tell(
    tmp_path: Path, files: Optional[dict[str, str]], version: str, expected: str
) -> None:
    (answer, *_) = read_from(torch_tree(tmp_path, files) if files is not None else tmp_path, version)
    assert answer.known is None and answer.text.startswith(expected.format(tmp_path)), answer.text
    assert answer.doubt is (version != "2.3.1")


# --------------------------------------------------------------------------------------------- doctor itself


def environment_with_torch(root: Path, installed: Path, torch_version: str, site_source: str) -> str:
    """The python of a venv with the package, wrapt, transformers 4.55.2 and a torch whose FSDP2
    module holds ``site_source`` (all fakes but the package and wrapt)."""
    throwaway = make_throwaway(root, installed)
    # The stand-in torch carries every site of the release it copies; then this source.
    files = {path.relative_to(STAND_IN).as_posix(): path.read_text(encoding="utf-8")
             for path in (STAND_IN / "torch").rglob("*.py")}
    files[SITE_2_6] = site_source
    for relative in ("torch/distributed/__init__.py", "torch/distributed/fsdp/__init__.py",
                     "torch/distributed/_composable/__init__.py",
                     "torch/distributed/fsdp/_fully_shard/__init__.py"):
        files[relative] = ""
    files["torch/__init__.py"] = f'__version__ = "{torch_version}"\n'
    add_distribution(throwaway.site_packages, "torch", torch_version, files)
    add_distribution(throwaway.site_packages, "transformers", "4.55.2",
                     {"transformers/__init__.py": '__version__ = "4.55.2"\n'})
    return str(throwaway.python)


def bug_in_matrix_here(python: str) -> bool:
    result = run_python("import json; from fsdp_autopatch import _config, _matrix; "
                        "print(json.dumps(_matrix.decide(_config.AUTO, '2.13.0', '4.55.2').in_matrix))",
                        python=python)
    return bool(json.loads(result.stdout))


@pytest.mark.parametrize("case", ["as torch 2.13.0 has it", "helper renamed"])
def test_doctor_strict_is_ok_only_for_a_layout_it_recognises(
    installed: Path, tmp_path: Path, case: str
) -> None:
    source = TORCH_2_13 if case == "as torch 2.13.0 has it" else TORCH_2_13.replace(
        "_apply_to_module", "_wrap_modules")
    python = environment_with_torch(tmp_path / "venv", installed, "2.13.0", source)
    if not bug_in_matrix_here(python):
        pytest.skip("this CPython accepts the ABC swap: the layout decides nothing here")
    command = [python, "-m", "fsdp_autopatch"]
    shown = run_cli("doctor", command=command)
    report = one_object(run_cli("doctor", "--json", command=command).stdout)
    known = report["sites"][0]["known"]  # fully_shard's
    if case == "as torch 2.13.0 has it":
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert shown.stdout.splitlines()[-1] == (
            f"OK: the patch will fix the bug in every process of this Python. {PROOF}")
        assert "   ok  FSDP2 fully_shard site known: _fsdp_init._apply_to_module" in shown.stdout.splitlines()
        assert (known, report["outcome"], report["would_apply"]) == (True, "OK", True)
        return
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert shown.stdout.splitlines()[-1] == (
        f"CANNOT TELL: files cannot tell whether the patch will fix it here. {PROOF}")
    assert "   ??  torch 2.13.0's FSDP2 layout is unknown to fsdp-autopatch" in shown.stdout
    assert (known, report["outcome"], report["would_apply"]) == (False, "CANNOT TELL", None)
    assert report["exit_code"] == 2 and report["problems"] == []


def test_doctor_strict_cannot_tell_for_a_torch_newer_than_the_matrix(installed: Path, tmp_path: Path) -> None:
    python = environment_with_torch(tmp_path / "venv", installed, "2.99.0", TORCH_2_13)
    command = [python, "-m", "fsdp_autopatch"]
    shown = run_cli("doctor", command=command)
    if not bug_in_matrix_here(python):
        # CPython 3.15+ accepts the ABC swap whatever torch builds: the Python row decides.
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert shown.stdout.splitlines()[-1].startswith("OK: nothing to fix: ")
        return
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert "   ??  torch 2.99.0 is newer than the version matrix: a probe decides at import" in shown.stdout
    assert shown.stdout.splitlines()[-1] == (
        f"CANNOT TELL: files cannot tell whether the patch will fix it here. {PROOF}")
    report = one_object(run_cli("doctor", "--json", env=environment(), command=command).stdout)
    assert report["sites"][0]["known"] is True
    assert (report["would_apply"], report["outcome"]) == (None, "CANNOT TELL")
    # Switched off, the patch certainly stays out, but whether that torch needs it is still unknown.
    off = run_cli("doctor", env=environment(FSDP_AUTOPATCH="0"), command=command)
    assert off.returncode == 2, off.stdout + off.stderr
    assert off.stdout.splitlines()[-1] == (
        "CANNOT TELL: torch 2.99.0 may need the patch, and it will not be applied: FSDP_AUTOPATCH=0 turns "
        "the patch off")
    # Forced, the patch applies whatever the matrix says.
    forced = run_cli("doctor", env=environment(FSDP_AUTOPATCH="force"), command=command)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert forced.stdout.splitlines()[-1] == (
        f"OK: FSDP_AUTOPATCH=force: the patch will be applied in every process. {PROOF}")


@pytest.mark.slow
@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_the_installed_torchs_own_files_are_known_and_their_edits_are_not(
    real_torch: dict[str, str], tmp_path: Path, release: Optional[made_up_releases.MadeUpRelease],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with a newer release's rows in the tables: doctor names the row the installed torch
    has, not the newest of its API."""
    made_up_releases.add_rows(release, monkeypatch.setattr)
    version = real_torch["torch"]
    answers = [Answer(_doctor.find_site(api, version)) for api in _sites.APIS]
    for answer in answers:
        if installed_version(_sites.distribution_of(answer.api)) is None:
            continue  # a wrapper whose distribution is not installed here (megatron-fsdp)
        if answer.known is None and not _sites.sites_of(answer.api, _matrix.release(version)):
            continue  # a wrapper this torch predates (FSDP2 replicate before 2.9)
        assert answer.known is True and answer.file is not None, answer.text
        assert answer.text.startswith(f"{answer.api} site known: ")
    # The fully_shard site's files, copied and then edited as a release moving away could.
    site = next(site for site in _sites.SITES if site.key == answers[0].site_key)
    sources = {}
    for module in dict.fromkeys((site.module, site.builder_module)):
        path = _doctor.module_file(module)
        assert path is not None
        sources["/".join(module.split(".")) + ".py"] = path.read_text(encoding="utf-8")
    builder_file = "/".join(site.builder_module.split(".")) + ".py"
    same = layout(tmp_path / "same", sources, version=version)
    assert same.known is True and same.site_key == site.key
    calls_type = edited(sources[builder_file], "new_cls = type(", "new_cls = builtins.type(")
    moved = layout(tmp_path / "attribute", {**sources, builder_file: calls_type}, version=version)
    assert moved.known is False and f"{site.builder} does not call the global type" in moved.text, moved.text
    assert moved.text.startswith(f"torch {version}'s FSDP2 layout is unknown")


def test_a_namespace_package_on_the_way_is_read_as_missing_not_a_crash(tmp_path: Path) -> None:
    root = torch_tree(tmp_path, {**TORCH_2_13_FILES, DDP: TORCH_DDP})
    (root / "torch" / "distributed" / "_composable" / "__init__.py").unlink()
    ddp = next(answer for answer in read_from(root, "2.13.0") if answer.api == _sites.DDP_REPLICATE)
    assert ddp.known is False and "none of the modules where it looks is there" in ddp.text
