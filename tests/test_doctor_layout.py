"""doctor's FSDP2 layout answer: torch's source files read with ``ast``, never a substring search.

A site counts only where its entry function (``fully_shard``), itself or through functions of
the same module it calls, reads the site's cache global by name (an ``ast.Name`` load that
resolves to the module, not an attribute or a local), or, where there is no cache, builds the
class with the module's ``type``. Fake torch source trees show each way a torch release could
move away from that; the real torch's file, copied and edited, shows the same.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Optional

import pytest
from conftest import environment, make_throwaway, run_python
from test_cli import add_distribution, one_object, run_cli

from fsdp_autopatch import _doctor, _patch

PROOF = "doctor reads files only; `fsdp-autopatch verify` is the proof"
SITE_2_6 = "torch/distributed/fsdp/_fully_shard/_fully_shard.py"
SITE_2_4 = "torch/distributed/_composable/fsdp/fully_shard.py"

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

# What torch 2.4's and 2.5's torch/distributed/_composable/fsdp/fully_shard.py define after
# fully_shard: the deepcopy stub and the wrapper class.
_TORCH_2_4_NAMES = '''

def unimplemented_deepcopy(*args, **kwargs):
    raise AssertionError("FSDP does not support deepcopy")


class FSDPModule:
    pass
'''

# torch 2.4's: the class built inline, no cache.
TORCH_2_4 = '''
def fully_shard(module, *, mesh=None):
    cls = module.__class__
    dct = {"__deepcopy__": unimplemented_deepcopy}
    new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), dct)
    module.__class__ = new_cls
    return module

''' + _TORCH_2_4_NAMES

# torch 2.5's: the same module, with the cache.
TORCH_2_5 = '''
cls_to_fsdp_cls = {}


def fully_shard(module, *, mesh=None):
    cls = module.__class__
    new_cls = cls_to_fsdp_cls.get(cls, None)
    if not new_cls:
        dct = {"__deepcopy__": unimplemented_deepcopy}
        new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), dct)
        cls_to_fsdp_cls[cls] = new_cls
    module.__class__ = new_cls
    return module

''' + _TORCH_2_4_NAMES


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


def layout(tmp_path: Path, files: dict[str, str], version: str = "2.13.0") -> _doctor.LayoutAnswer:
    return _doctor.check_layout(version, search=[str(torch_tree(tmp_path, files))])


# --------------------------------------------------------------------------------------------- known layouts


def test_torch_2_13s_layout_is_known_with_the_function_and_the_wrapper_named(tmp_path: Path) -> None:
    answer = layout(tmp_path, {SITE_2_6: TORCH_2_13})
    assert answer.known is True
    assert answer.site == "torch.distributed.fsdp._fully_shard._fully_shard.cls_to_fsdp_cls"
    assert answer.wrapper == "FSDPModule" and answer.file == str(tmp_path / SITE_2_6)
    assert answer.text == (
        "known: torch.distributed.fsdp._fully_shard._fully_shard.cls_to_fsdp_cls: fully_shard reads the "
        f"global cls_to_fsdp_cls (wrapper class FSDPModule, in {SITE_2_6}); {PROOF}")
    assert "will fix" not in answer.text


def test_a_read_through_a_function_of_the_same_module_counts(tmp_path: Path) -> None:
    source = edited(TORCH_2_13, f"    {APPLY_CALL}", f"    _construct(modules)\n\ndef _construct(modules):\n"
                                                     f"    {APPLY_CALL}")
    answer = layout(tmp_path, {SITE_2_6: source})
    assert answer.known is True
    assert "fully_shard reads the global cls_to_fsdp_cls through _construct" in answer.text


def test_a_read_in_a_closure_and_under_a_global_statement_count(tmp_path: Path) -> None:
    closure = edited(TORCH_2_13, f"    {APPLY_CALL}", f"    def later():\n        {APPLY_CALL}")
    assert layout(tmp_path / "closure", {SITE_2_6: closure}).known is True
    declared = edited(TORCH_2_13, f"    {APPLY_CALL}", f"    global cls_to_fsdp_cls\n"
                                                      f"    cls_to_fsdp_cls = cls_to_fsdp_cls or {{}}\n"
                                                      f"    {APPLY_CALL}")
    assert layout(tmp_path / "declared", {SITE_2_6: declared}).known is True


def test_torch_2_4s_inline_construction_is_known_by_its_type_call(tmp_path: Path) -> None:
    answer = layout(tmp_path, {SITE_2_4: TORCH_2_4}, version="2.4.1")
    assert (answer.known, answer.site) == (True, "torch.distributed._composable.fsdp.fully_shard.type")
    assert "fully_shard reads type, calling type(..., (FSDPModule, cls), ...)" in answer.text
    assert answer.text.endswith(PROOF)


def test_torch_2_5s_cache_in_the_old_module_is_known(tmp_path: Path) -> None:
    answer = layout(tmp_path, {SITE_2_4: TORCH_2_5}, version="2.5.1")
    assert answer.known is True
    assert answer.site == "torch.distributed._composable.fsdp.fully_shard.cls_to_fsdp_cls"


# ------------------------------------------------------------------------------------------- unknown layouts


@pytest.mark.parametrize("case, source, why", [
    ("renamed cache", TORCH_2_13.replace("cls_to_fsdp_cls", "_cls_to_fsdp_cls"), "no global cls_to_fsdp_cls"),
    ("read as an attribute", edited(
        TORCH_2_13, APPLY_CALL, "_apply_to_module(modules, _state.cls_to_fsdp_cls, FSDPModule").replace(
        "from ._fsdp_init import", "from . import _state\nfrom ._fsdp_init import"),
     "fully_shard (and the functions of this module it calls) never reads the global cls_to_fsdp_cls (it "
     "reads cls_to_fsdp_cls as an attribute)"),
    ("another dict", edited(
        TORCH_2_13, APPLY_CALL, "_apply_to_module(modules, _wrapper_classes, FSDPModule").replace(
        "cls_to_fsdp_cls: dict[type, type] = {}", "cls_to_fsdp_cls: dict[type, type] = {}\n"
                                                  "_wrapper_classes: dict[type, type] = {}"),
     "fully_shard (and the functions of this module it calls) never reads the global cls_to_fsdp_cls"),
    ("a local of the same name", edited(
        TORCH_2_13, f"    {APPLY_CALL}", f"    cls_to_fsdp_cls = {{}}\n    {APPLY_CALL}"),
     "never reads the global cls_to_fsdp_cls (a local cls_to_fsdp_cls hides the global)"),
    ("a parameter of the same name", edited(
        TORCH_2_13, "def fully_shard(module, *, mesh=None):",
        "def fully_shard(module, *, mesh=None, cls_to_fsdp_cls=None):"),
     "(a local cls_to_fsdp_cls hides the global)"),
    ("no longer a dict", edited(
        TORCH_2_13, "cls_to_fsdp_cls: dict[type, type] = {}",
        "cls_to_fsdp_cls = weakref.WeakKeyDictionary()"),
     "the global cls_to_fsdp_cls is not assigned a dict"),
    ("no fully_shard", edited(TORCH_2_13, "def fully_shard(module, *", "def shard(module, *"),
     "no function fully_shard"),
])
def test_a_layout_that_moved_away_is_unknown_not_ok(tmp_path: Path, case: str, source: str, why: str) -> None:
    answer = layout(tmp_path, {SITE_2_6: source})
    assert answer.known is False, case
    assert answer.text.startswith("torch 2.13.0's FSDP2 layout is unknown to fsdp-autopatch ")
    assert f"{SITE_2_6}: " in answer.text and why in answer.text, answer.text
    assert answer.text.endswith(PROOF) and "will fix" not in answer.text


def test_an_inline_type_that_is_not_the_modules_global_is_unknown(tmp_path: Path) -> None:
    local = edited(TORCH_2_4, "def fully_shard(module, *, mesh=None):",
                   "def fully_shard(module, *, mesh=None, type=type):")
    answer = layout(tmp_path / "local", {SITE_2_4: local}, version="2.4.1")
    assert answer.known is False
    # The module is both sites' (torch 2.5 added the cache there): what each found missing.
    assert f"{SITE_2_4}: no global cls_to_fsdp_cls, and fully_shard (and the functions of this module it " \
           "calls) never builds a class with the global type and FSDPModule first (a local type hides the " \
           "global)" in answer.text
    other = edited(TORCH_2_4, "(FSDPModule, cls)", "(cls, FSDPModule)")
    answer = layout(tmp_path / "order", {SITE_2_4: other}, version="2.4.1")
    assert answer.known is False
    assert "never builds a class with the global type and FSDPModule first" in answer.text


def test_a_re_exporting_shim_is_not_a_site(tmp_path: Path) -> None:
    # torch 2.6+ keeps the 2.4 module as a shim importing fully_shard from its new home.
    shim = "from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401\n"
    renamed = TORCH_2_13.replace("cls_to_fsdp_cls", "_cls_to_fsdp_cls")
    answer = layout(tmp_path, {SITE_2_6: renamed, SITE_2_4: shim})
    assert answer.known is False
    assert f"{SITE_2_6}: no global cls_to_fsdp_cls" in answer.text
    assert f"{SITE_2_4}: no unimplemented_deepcopy" in answer.text


def test_a_torch_without_fsdp2_files_is_unknown(tmp_path: Path) -> None:
    answer = layout(tmp_path, {})
    assert answer.known is False
    assert "none of the modules where it looks for the class construction is in torch's files" in answer.text


@pytest.mark.parametrize("files, version, expected", [
    ({SITE_2_6: "def fully_shard(:\n"}, "2.13.0", "cannot tell: this Python cannot parse " + SITE_2_6),
    (None, "2.13.0", "cannot tell: torch 2.13.0 is installed, but no torch package with source files"),
    ({}, "2.3.1", "torch 2.3.1 has no FSDP2"),
])
def test_what_files_cannot_answer_is_cannot_tell(
    tmp_path: Path, files: Optional[dict[str, str]], version: str, expected: str
) -> None:
    search = [str(torch_tree(tmp_path, files) if files is not None else tmp_path)]
    answer = _doctor.check_layout(version, search=search)
    assert answer.known is None and answer.text.startswith(expected), answer.text
    assert answer.doubt is (version != "2.3.1")


def test_every_site_the_patch_knows_is_read_by_its_own_names() -> None:
    # The reader takes the names from _patch's sites, so a site added there is read alike.
    for site in (*_patch.FULLY_SHARD_SITES, _patch.REPLICATE_SITE):
        reading = _doctor.read_site(site, "")
        assert reading.found is False and site.wrappers[0] in reading.detail


# --------------------------------------------------------------------------------------------- doctor itself


def environment_with_torch(root: Path, installed: Path, torch_version: str, site_source: str) -> str:
    """The python of a venv with the package, wrapt, transformers 4.55.2 and a torch whose FSDP2
    module holds ``site_source`` (all fakes but the package and wrapt)."""
    throwaway = make_throwaway(root, installed)
    files = {SITE_2_6: site_source}
    for relative in ("torch/distributed/__init__.py", "torch/distributed/fsdp/__init__.py",
                     "torch/distributed/fsdp/_fully_shard/__init__.py"):
        files[relative] = ""
    files["torch/__init__.py"] = f'__version__ = "{torch_version}"\n'
    add_distribution(throwaway.site, "torch", torch_version, files)
    add_distribution(throwaway.site, "transformers", "4.55.2",
                     {"transformers/__init__.py": '__version__ = "4.55.2"\n'})
    return str(throwaway.python)


def bug_in_matrix_here(python: str) -> bool:
    result = run_python("import json; from fsdp_autopatch import _config, _matrix; "
                        "print(json.dumps(_matrix.decide(_config.AUTO, '2.13.0', '4.55.2').in_matrix))",
                        python=python)
    return bool(json.loads(result.stdout))


@pytest.mark.parametrize("case", ["as torch 2.13.0 has it", "cache renamed"])
def test_doctor_strict_is_ok_only_for_a_layout_it_recognises(
    installed: Path, tmp_path: Path, case: str
) -> None:
    source = TORCH_2_13 if case == "as torch 2.13.0 has it" else TORCH_2_13.replace(
        "cls_to_fsdp_cls", "_cls_to_fsdp_cls")
    python = environment_with_torch(tmp_path / "venv", installed, "2.13.0", source)
    if not bug_in_matrix_here(python):
        pytest.skip("this CPython accepts the ABC swap: the layout decides nothing here")
    command = [python, "-m", "fsdp_autopatch"]
    strict = run_cli("doctor", "--strict", command=command)
    report = one_object(run_cli("doctor", "--json", command=command).stdout)
    assert "will fix" not in strict.stdout
    if case == "as torch 2.13.0 has it":
        assert strict.returncode == 0, strict.stdout + strict.stderr
        assert strict.stdout.splitlines()[-1].startswith("OK: torch 2.13.0 with transformers 4.55.2 has the "
                                                         "FSDP2 layout bug; the installed patch is set up")
        assert strict.stdout.splitlines()[-1].endswith(PROOF)
        assert (report["layout_known"], report["outcome"], report["would_apply"]) == (True, "OK", True)
        return
    assert strict.returncode == 2, strict.stdout + strict.stderr
    assert strict.stdout.splitlines()[-1].startswith(
        "CANNOT TELL: torch 2.13.0's FSDP2 layout is unknown to fsdp-autopatch ")
    assert (report["layout_known"], report["outcome"], report["would_apply"]) == (False, "CANNOT TELL", None)
    assert report["strict_exit_code"] == 2 and report["problems"] == []
    assert run_cli("doctor", command=command).returncode == 0, "without --strict doctor only reports"


def test_doctor_strict_cannot_tell_for_a_torch_newer_than_the_matrix(installed: Path, tmp_path: Path) -> None:
    python = environment_with_torch(tmp_path / "venv", installed, "2.99.0", TORCH_2_13)
    command = [python, "-m", "fsdp_autopatch"]
    strict = run_cli("doctor", "--strict", command=command)
    if not bug_in_matrix_here(python):
        # CPython 3.15+ accepts the ABC swap whatever torch builds: the Python row decides.
        assert strict.returncode == 0, strict.stdout + strict.stderr
        assert strict.stdout.splitlines()[-1].startswith("OK: nothing to fix: CPython ")
        return
    assert strict.returncode == 2, strict.stdout + strict.stderr
    assert strict.stdout.splitlines()[-1].startswith("CANNOT TELL: torch 2.99.0 is newer than the matrix")
    report = one_object(run_cli("doctor", "--json", env=environment(), command=command).stdout)
    assert (report["layout_known"], report["would_apply"], report["outcome"]) == (True, None, "CANNOT TELL")
    # Switched off, the patch certainly stays out, but whether that torch needs it is still unknown.
    off = run_cli("doctor", "--strict", env=environment(FSDP_AUTOPATCH="0"), command=command)
    assert off.returncode == 2, off.stdout + off.stderr
    assert off.stdout.splitlines()[-1] == (
        "CANNOT TELL: torch 2.99.0 is newer than the matrix and may still need the patch, but "
        "FSDP_AUTOPATCH=0 disables the patch; unset FSDP_AUTOPATCH (or set it to auto)")
    # Forced, the patch applies whatever the matrix says.
    forced = run_cli("doctor", "--strict", env=environment(FSDP_AUTOPATCH="force"), command=command)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert forced.stdout.splitlines()[-1].startswith("OK: FSDP_AUTOPATCH=force: patching torch 2.99.0")


@pytest.mark.slow
def test_the_installed_torchs_own_file_is_known_and_its_edits_are_not(
    real_torch: dict[str, str], tmp_path: Path
) -> None:
    answer = _doctor.check_layout(real_torch["torch"])
    assert answer.known is True and answer.file is not None, answer.text
    assert answer.text.endswith(PROOF)
    source = Path(answer.file).read_text(encoding="utf-8")
    relative = _doctor.module_file(str(answer.site).rsplit(".", 1)[0])
    assert relative is not None and Path(answer.file) == relative
    site_path = "/".join(str(answer.site).split(".")[:-1]) + ".py"
    cache = str(answer.site).rsplit(".", 1)[1]
    if cache == "type":
        pytest.skip(f"torch {real_torch['torch']} builds its classes inline: the cache edits do not apply")
    same = layout(tmp_path / "same", {site_path: source}, version=real_torch["torch"])
    assert same.known is True and same.site == answer.site
    # Every read of the cache by name becomes an attribute read, as if it had moved to a state object.
    reads = [line for line in source.splitlines() if cache in line and "=" not in line.split(cache)[0]
             and not line.lstrip().startswith(("def ", "#", cache))]
    assert reads, f"no read of {cache} in {answer.file}"
    as_attribute = source
    for line in set(reads):
        as_attribute = edited(as_attribute, line, line.replace(cache, f"_state.{cache}"))
    for name, edit in (("renamed", source.replace(cache, f"_{cache}")), ("attribute", as_attribute)):
        moved = layout(tmp_path / name, {site_path: edit}, version=real_torch["torch"])
        assert moved.known is False, (name, moved.text)
        assert moved.text.startswith(f"torch {real_torch['torch']}'s FSDP2 layout is unknown")
