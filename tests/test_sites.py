"""``_sites``: the one table of the places where torch swaps a module's class, the bytecode check
that finds them, and the sweep that notices a torch release adding another.

The sweep reads the installed torch's source files (it imports nothing of torch) and lists every
assignment to an object's ``__class__``: each one must be the builder of a site the patch covers,
or be listed in ``version_table.OTHER_CLASS_SWAPS`` with the reason it is left alone. A test of a
stand-in torch tree shows that a new swap makes it fail.
"""

from __future__ import annotations

import ast
import shutil
import textwrap
import types
from pathlib import Path
from typing import Any, Callable, Optional

import made_up_releases
import pytest
import version_table
from conftest import (
    PROGRAMS,
    abc_swap_refused,
    fake_torch,
    fake_transformers,
    json_lines,
    make_throwaway,
    run_program,
    site_packages,
)

from fsdp_autopatch import _patch, _sites

TYPE_GLOBAL = """
def builder(modules, cache, wrapper, prefix, deepcopy):
    for module in modules:
        cls = module.__class__
        new_cls = type(f"{prefix}{cls.__name__}", (wrapper, cls), {"__deepcopy__": deepcopy})
        module.__class__ = new_cls
"""


def compiled(source: str) -> dict[str, list[types.CodeType]]:
    code = compile(textwrap.dedent(source), "<torch>", "exec")
    functions: dict[str, list[types.CodeType]] = {}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            functions.setdefault(const.co_name, []).append(const)
    return functions


def lookups(modules: dict[str, tuple[set[str], str]], origins: Optional[dict[tuple[str, str], str]] = None
            ) -> tuple[Callable[..., bool], Callable[..., Any], Callable[..., Optional[str]]]:
    """``has``, ``code_of`` and ``origin`` over stand-in modules: name -> (top-level names, source);
    ``origins``: (module, name) -> where that binding comes from, where known."""
    functions = {name: compiled(source) for name, (_, source) in modules.items()}

    def has(module: str, name: str) -> bool:
        return module in modules and name in modules[module][0]

    def code_of(module: str, name: str) -> list[types.CodeType]:
        return functions.get(module, {}).get(name, [])

    def origin(module: str, name: str) -> Optional[str]:
        return (origins or {}).get((module, name))

    return has, code_of, origin


INLINE = _sites.Site("test", (0,), "m", "wrap", ("Wrapper",), "W", "deepcopy")
HELPER = _sites.Site("test", (0,), "m", "wrap", ("Wrapper",), "W", "deepcopy", builder=("h", "builder", ()))


def test_an_inline_site_is_found_by_its_type_call() -> None:
    source = TYPE_GLOBAL.replace("builder(modules, cache, wrapper, prefix, deepcopy)", "wrap(modules)")
    assert _sites.shape_problem(INLINE, *lookups({"m": ({"Wrapper", "deepcopy", "wrap"}, source)})) is None


def test_a_helper_site_needs_the_entry_to_call_the_helper() -> None:
    calls = "def wrap(modules):\n    builder(modules, {}, Wrapper, 'W', deepcopy)\n"
    helper = {"h": ({"builder"}, TYPE_GLOBAL)}
    found = lookups({"m": ({"Wrapper", "deepcopy", "wrap", "builder"}, calls), **helper})
    assert _sites.shape_problem(HELPER, *found) is None
    idle = "def wrap(modules):\n    pass\n"
    found = lookups({"m": ({"Wrapper", "deepcopy", "wrap", "builder"}, idle), **helper})
    assert _sites.shape_problem(HELPER, *found) == "wrap does not call builder"
    # The entry calls the helper by the name its own module binds: no binding, no call.
    found = lookups({"m": ({"Wrapper", "deepcopy", "wrap"}, calls), **helper})
    assert _sites.shape_problem(HELPER, *found) == "no builder"


def test_a_helper_site_needs_the_entrys_helper_to_come_from_the_rows_module() -> None:
    """A release that moves a helper and keeps one of the same name in the old module (or a
    stand-in holding a newer release's module too): the row of the place the entry does not
    call is not that release's, and would patch a function torch never runs."""
    site = _sites.Site("test", (0,), "t.m", "wrap", ("Wrapper",), "W", "deepcopy",
                       builder=("t.h", "builder", ()))
    calls = "def wrap(modules):\n    builder(modules, {}, Wrapper, 'W', deepcopy)\n"
    modules = {"t.m": ({"Wrapper", "deepcopy", "wrap", "builder"}, calls), "t.h": ({"builder"}, TYPE_GLOBAL),
               "t.moved": ({"builder"}, TYPE_GLOBAL)}
    assert _sites.shape_problem(site, *lookups(modules, {("t.m", "builder"): "t.h"})) is None
    moved = lookups(modules, {("t.m", "builder"): "t.moved"})
    assert _sites.shape_problem(site, *moved) == "builder comes from t.moved"
    # Where the binding's origin cannot be told (a value assigned), or is no module of the
    # builder's package (a user's replacement, which says nothing of the release), the names and
    # bytecode decide.
    assert _sites.shape_problem(site, *lookups(modules)) is None
    assert _sites.shape_problem(site, *lookups(modules, {("t.m", "builder"): "__main__"})) is None


@pytest.mark.parametrize(("names", "source", "problem"), [
    ({"deepcopy", "wrap"}, "def wrap(m):\n    type('W', (object, m), {})\n", "no Wrapper class"),
    ({"Wrapper", "wrap"}, "def wrap(m):\n    type('W', (object, m), {})\n", "no deepcopy"),
    # A local type, a parameter named type, an attribute: rebinding the module's global reaches none.
    ({"Wrapper", "deepcopy", "wrap"}, "def wrap(m, type):\n    type('W', (object, m), {})\n",
     "wrap does not call the global type"),
    ({"Wrapper", "deepcopy", "wrap"}, "def wrap(m):\n    builtins.type('W', (object, m), {})\n",
     "wrap does not call the global type"),
])
def test_what_keeps_a_site_from_being_patched_is_named(names: set[str], source: str, problem: str) -> None:
    assert _sites.shape_problem(INLINE, *lookups({"m": (names, source)})) == problem


def test_a_type_call_in_a_nested_function_reaches_the_global() -> None:
    source = "def wrap(m):\n    def inner():\n        return type('W', (object, m), {})\n    return inner()\n"
    assert _sites.shape_problem(INLINE, *lookups({"m": ({"Wrapper", "deepcopy", "wrap"}, source)})) is None


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_the_start_up_names_come_from_the_table(
    release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up watches each torch row's module and the package users import its entry from, and
    no builder module: a builder is imported by its entry's module (the entry's module binds it),
    so the entry's import finds it loaded. Megatron-FSDP's module is watched beside torch's."""
    made_up_releases.add_rows(release, monkeypatch.setattr)
    torch_sites = [site for site in _sites.SITES if _sites.distribution_of(site.api) == "torch"]
    assert set(_sites.TORCH_MODULES) == {name for site in torch_sites for name in (site.module, site.package)}
    assert set(_sites.WATCHED_MODULES) == {*_sites.TORCH_MODULES, *(site.module for site in _sites.SITES)}
    assert {site.api for site in _sites.SITES} == set(_sites.APIS)


@pytest.mark.parametrize("release", made_up_releases.TABLES, ids=made_up_releases.table_id)
def test_every_row_has_a_key_of_its_own_and_each_apis_rows_are_newest_first(
    release: Optional[made_up_releases.MadeUpRelease], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row of an API shares the entry's name; the key names the row itself, and the first
    row a release may have is its newest (torch's fix first, in a release that has it)."""
    made_up_releases.add_rows(release, monkeypatch.setattr)
    keys = [site.key for site in _sites.SITES]
    assert len(set(keys)) == len(keys), keys
    for api in _sites.APIS:
        order = [(site.since, site.fixed) for site in _sites.sites_of(api)]
        assert order == sorted(order, reverse=True), (api, order)


def test_a_rows_key_says_its_api_its_first_release_and_torchs_fix() -> None:
    row = _sites.Site(_sites.FULLY_SHARD, (2, 11), "m", "wrap", ("Wrapper",), "W", "deepcopy")
    assert row.key == "FSDP2 fully_shard since torch 2.11" and row.key in repr(row)
    fixed = _sites.Site(_sites.FULLY_SHARD, (2, 11), "m", "wrap", ("Wrapper",), "W", "deepcopy",
                        torch_fix=("f", "make"))
    assert fixed.key == "FSDP2 fully_shard since torch 2.11 with torch's fix"
    megatron = _sites.Site(_sites.MEGATRON_FULLY_SHARD, (0, 6), "m", "wrap", ("Wrapper",), "W", None)
    assert megatron.key == "Megatron-FSDP fully_shard since megatron-fsdp 0.6"


# --------------------------------------------------------------------------------------------- the sweep


def class_swaps(torch_dir: Path) -> list[tuple[str, str, int]]:
    """Every assignment to ``X.__class__`` (and every ``setattr(X, "__class__", ...)``) in the
    Python files under ``torch_dir``: (file relative to it, enclosing qualified name, line)."""
    found = []
    for path in sorted(torch_dir.rglob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        if "__class__" not in source:
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a file this Python cannot parse holds no site it could import either
            continue
        relative = path.relative_to(torch_dir).as_posix()

        def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, (*scope, child.name))
                    continue
                if is_class_swap(child):
                    found.append((relative, ".".join(scope) or "<module>", child.lineno))  # noqa: B023
                visit(child, scope)

        visit(tree, ())
    return found


def is_class_swap(node: ast.AST) -> bool:
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = [element for target in node.targets
                   for element in (target.elts if isinstance(target, ast.Tuple) else [target])]
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    if any(isinstance(target, ast.Attribute) and target.attr == "__class__" for target in targets):
        return True
    return (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("setattr")
            and any(isinstance(arg, ast.Constant) and arg.value == "__class__" for arg in node.args))


def unaccounted(swaps: list[tuple[str, str, int]], package: str = "torch") -> list[tuple[str, str, int]]:
    """The swaps found in ``package``'s files that are neither a site's builder nor left alone."""
    covered = {(site.builder_module.replace(".", "/").removeprefix(f"{package}/") + ".py", site.builder)
               for site in _sites.SITES}
    swaps_left = version_table.OTHER_CLASS_SWAPS
    left_alone = {(swap.file, swap.function) for swap in swaps_left if swap.package == package}
    return [swap for swap in swaps
            if swap[:2] not in covered | left_alone and (swap[0], "*") not in left_alone]


def installed(package: str) -> Path:
    directory = site_packages() / package
    if not (directory / "__init__.py").is_file():
        pytest.skip(f"{package} is not installed here; run the tests with: nox -f tests/noxfile.py -s tests")
    return directory


@pytest.mark.slow
def test_every_class_swap_of_the_installed_torch_is_a_site_or_left_alone_with_a_reason() -> None:
    swaps = class_swaps(installed("torch"))
    assert unaccounted(swaps) == [], (
        "torch swaps a class where fsdp-autopatch neither patches nor says why it need not: add a "
        "Site to fsdp_autopatch/_sites.py, or a ClassSwap with the reason to tests/version_table.py")
    # The sites of this torch are among what was found, so the sweep sees them.
    assert {(file, function) for file, function, _ in swaps} & {
        ("distributed/_composable/replicate.py", "replicate")}


@pytest.mark.slow
def test_every_class_swap_of_the_installed_megatron_fsdp_is_a_site_or_left_alone_with_a_reason() -> None:
    swaps = class_swaps(installed("megatron_fsdp"))
    assert unaccounted(swaps, "megatron_fsdp") == [], (
        "megatron-fsdp swaps a class where fsdp-autopatch neither patches nor says why it need not: "
        "add a Site to fsdp_autopatch/_sites.py, or a ClassSwap to tests/version_table.py")
    found = {(file, function) for file, function, _ in swaps}
    assert ("experimental/fully_shard.py", "_attach_mixin") in found


@pytest.mark.slow
def test_the_wrappers_call_super_only_for_their_own_name() -> None:
    """The fix refuses a mirror where the module's class defines a method the wrapper's
    same-named method reaches with ``super()`` (FSDPModule._apply); that is every
    case while torch's wrappers call ``super()`` for their own name alone."""
    installed("torch")
    (report,) = json_lines(run_program(PROGRAMS / "wrapper_super_calls.py").stdout)
    assert report, "no wrapper method calls super(): the sweep did not see torch's classes"
    for method, names in report.items():
        assert set(names) <= {method.rsplit(".", 1)[1]}, (method, names)


def test_a_new_class_swap_in_torch_fails_the_sweep(tmp_path: Path) -> None:
    torch_dir = tmp_path / "torch"
    (torch_dir / "distributed" / "_composable").mkdir(parents=True)
    (torch_dir / "distributed" / "_composable" / "replicate.py").write_text(
        "def replicate(module):\n    module.__class__ = type('DDPX', (DDP, module.__class__), {})\n")
    (torch_dir / "distributed" / "new_wrapper.py").write_text(
        "def wrap(module):\n    setattr(module, '__class__', type('NewX', (New, type(module)), {}))\n")
    assert unaccounted(class_swaps(torch_dir)) == [("distributed/new_wrapper.py", "wrap", 2)]


# ------------------------------------------------------------------------------- made-up releases


def run_made_up(tmp_path: Path, installed: Path, release: made_up_releases.MadeUpRelease,
                version: Optional[str] = None, files: Optional[list[str]] = None) -> dict[str, Any]:
    """made_up_run.py's report in a venv whose stand-in torch is the made-up ``release`` (or the
    stand-in, at ``version``, holding only ``files`` of tests/stand_in/made_up/), with the
    release's rows in the package's tables from interpreter start, as if they were in its source:
    a ``.pth`` file the site module reads before fsdp_autopatch.pth (it reads them in sorted order)."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages, version=version or release.torch)
    fake_transformers(env.site_packages)
    if files is None:
        made_up_releases.lay_over(env.site_packages, release)
    for file in files or ():  # "<release>/torch/...": that release's module, in the stand-in
        shutil.copy2(made_up_releases.MADE_UP / file, env.site_packages / file.split("/", 1)[1])
    (env.site_packages / "_made_up_release.pth").write_text(
        f"{PROGRAMS}\nimport made_up_releases; made_up_releases.add_rows_at_start({release.torch!r})\n")
    result = env.run_program(PROGRAMS / "made_up_run.py", release.torch)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    (report,) = json_lines(result.stdout)
    report["torch"] = env.site_packages / "torch"
    return report


def assert_wrapped(report: dict[str, Any], rows: dict[str, str]) -> None:
    """Each API of ``rows`` went through its row (the patch's, the probe's and doctor's alike),
    and built what the package builds: its compatible class for the ABC module where CPython
    refuses torch's, torch's own for the plain one."""
    status = report["status"]
    assert {api: report["wrappers"][api]["row"] for api in rows} == rows, report["wrappers"]
    for api in rows:
        wrapper = report["wrappers"][api]
        assert wrapper["doctor"]["known"] is True and wrapper["doctor"]["site_key"] == rows[api], wrapper
        head, plain = wrapper["classes"]["Head"], wrapper["classes"]["Plain"]
        assert plain["is_wrapper"] and plain["torch_bases"], plain
        assert head["name"] == plain["name"].replace("Plain", "Head") and head["is_wrapper"], head
        if abc_swap_refused():  # CPython 3.9 - 3.14: patched through the row's builder
            assert wrapper["probe"] == _patch.TORCH_REFUSED and not head["torch_bases"]
            assert wrapper["site"] in status["sites"], (wrapper["site"], status["sites"])
        else:  # CPython 3.15+: torch's class, left alone
            assert wrapper["probe"] == _patch.TORCH_ACCEPTED and head["torch_bases"]
    assert status["applied"] is abc_swap_refused() and status["in_matrix"] is abc_swap_refused(), status
    assert report["doctor"]["outcome"] == "OK", report["doctor"]


def assert_swept(report: dict[str, Any], release: made_up_releases.MadeUpRelease,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The release's class swaps are unaccounted for without its rows, and covered with them."""
    swaps = class_swaps(report["torch"])
    builders = {(site.builder_module.replace(".", "/").removeprefix("torch/") + ".py", site.builder)
                for each in made_up_releases.releases_up_to(release) for site in each.sites}
    assert {swap[:2] for swap in unaccounted(swaps)} == builders
    made_up_releases.add_rows(release, monkeypatch.setattr)
    assert unaccounted(swaps) == []


def test_a_release_that_moves_the_helper_both_fsdp2_wrappers_share_is_a_row_per_wrapper(
    tmp_path: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made-up torch 99.1 moves FSDP2's shared helper to a module of its own, parameters renamed and
    reordered, and keeps the old one: its two rows, one per wrapper, are what the hooks patch, the
    probe asks (its arguments matched by the row's names), doctor reads and the sweep accounts for;
    composable DDP, which did not move, keeps its row."""
    release = made_up_releases.MOVES_THE_SHARED_HELPER
    report = run_made_up(tmp_path, installed, release)
    assert_wrapped(report, {site.api: site.key for site in release.sites})
    assert report["wrappers"][_sites.DDP_REPLICATE]["row"] == "composable DDP replicate since torch 2.4"
    assert_swept(report, release, monkeypatch)


def test_a_release_that_adds_an_api_in_a_new_module_is_its_label_its_row_and_its_module_watched(
    tmp_path: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made-up torch 99.2 adds made_up_wrap in a module of its own: with its label in APIS, its row
    and its module in TORCH_MODULES, its first import registers the hooks (they wait for transformers
    alone), and it is patched, probed, read by doctor and swept like the others."""
    release = made_up_releases.ADDS_AN_API
    report = run_made_up(tmp_path, installed, release)
    assert report["at_new_modules"] == "waiting for transformers to be imported"
    assert_wrapped(report, {site.api: site.key for site in release.sites})
    assert_swept(report, release, monkeypatch)


def test_a_release_that_fixes_the_bug_at_every_site_is_left_to_torch(
    tmp_path: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made-up torch 99.3 calls torch's fix (upstream/torch.diff's make_wrapper_cls) in every
    builder: a row with torch's fix for each wrapper whose builder had none (composable DDP's,
    which has one since 2.13, needs none) and its torch row fixed. The probe finds torch building
    accepted classes at every site, nothing of torch's is patched, and the rows agree: not in the
    matrix's bug, nor doctor's."""
    release = made_up_releases.FIXES_THE_BUG
    report = run_made_up(tmp_path, installed, release)
    rows = {**{site.api: site.key for site in release.sites},
            _sites.DDP_REPLICATE: "composable DDP replicate since torch 2.13 with torch's fix"}
    wrappers, status = report["wrappers"], report["status"]
    assert {api: wrappers[api]["row"] for api in rows} == rows, wrappers
    for api, wrapper in wrappers.items():
        assert wrapper["doctor"]["known"] and wrapper["doctor"]["fixed"], (api, wrapper["doctor"])
        assert wrapper["doctor"]["site_key"] == rows[api]
        head, plain = wrapper["classes"]["Head"], wrapper["classes"]["Plain"]
        assert head["is_wrapper"] and plain["is_wrapper"] and plain["torch_bases"], wrapper["classes"]
        # torch's own fix built the ABC module a class CPython accepts (3.9 - 3.14), or its own (3.15+).
        refused = abc_swap_refused()
        assert wrapper["probe"] == (_patch.TORCH_FIXED if refused else _patch.TORCH_ACCEPTED), wrapper
        assert head["torch_bases"] is not refused
    assert (status["applied"], status["sites"], status["classes"]) == (False, [], []), status
    assert (status["in_matrix"], status["decided_by"]) == (False, "probe"), status
    assert report["doctor"]["outcome"] == "OK", report["doctor"]
    assert report["doctor"]["verdict"].startswith("OK: nothing to fix: torch 99.3.0, transformers 4.55.2, ")
    assert_swept(report, release, monkeypatch)


@pytest.mark.parametrize("version", ["2.13.0", "99.1.0"])
def test_a_newer_releases_row_is_not_taken_for_a_torch_whose_wrappers_call_the_old_helper(
    tmp_path: Path, installed: Path, version: str
) -> None:
    """The stand-in of torch 2.13 holding made-up 99.1's helper module (the same name in a new
    place) and 99.2's made_up_wrap module, with both releases' rows in the tables: fully_shard and
    replicate still call the old helper, so the patch and doctor take the 2.11 rows. At 2.13.0 by
    release, and at a 99.1.0 that did not move it, because each wrapper's helper comes from
    _fsdp_init, not from the 99.1 row's module. made_up_wrap's row is 99.2's: neither has it."""
    release = made_up_releases.ADDS_AN_API
    report = run_made_up(tmp_path, installed, release, version,
                         files=["99.1.0/torch/distributed/_composable/_swap_class.py",
                                "99.2.0/torch/distributed/_composable/made_up_wrap.py"])
    assert_wrapped(report, {_sites.FULLY_SHARD: "FSDP2 fully_shard since torch 2.11",
                            _sites.FSDP2_REPLICATE: "FSDP2 replicate since torch 2.11"})
    made_up_wrap = report["wrappers"][made_up_releases.MADE_UP_WRAP]
    assert made_up_wrap["row"] is None and made_up_wrap["doctor"] == {
        "known": None, "site_key": None, "fixed": False,
        "text": f"torch {version} has no {made_up_releases.MADE_UP_WRAP}"}, made_up_wrap
