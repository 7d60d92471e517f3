"""``_sites``: the one table of the places where torch swaps a module's class, the bytecode check
that finds them, and the sweep that notices a torch release adding another.

The sweep reads the installed torch's source files (it imports nothing of torch) and lists every
assignment to an object's ``__class__``: each one must be the builder of a site the patch covers,
or be listed in ``version_table.OTHER_CLASS_SWAPS`` with the reason it is left alone. A test of a
stand-in torch tree shows that a new swap makes it fail.
"""

from __future__ import annotations

import ast
import textwrap
import types
from pathlib import Path
from typing import Any, Callable

import pytest
import version_table
from conftest import (
    PROGRAMS,
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


def lookups(modules: dict[str, tuple[set[str], str]]) -> tuple[Callable[..., bool], Callable[..., Any]]:
    """``has`` and ``code_of`` over stand-in modules: name -> (top-level names, source)."""
    functions = {name: compiled(source) for name, (_, source) in modules.items()}

    def has(module: str, name: str) -> bool:
        return module in modules and name in modules[module][0]

    def code_of(module: str, name: str) -> list[types.CodeType]:
        return functions.get(module, {}).get(name, [])

    return has, code_of


INLINE = _sites.Site("test", (0,), "m", "wrap", ("Wrapper",), "W", "deepcopy")
HELPER = _sites.Site("test", (0,), "m", "wrap", ("Wrapper",), "W", "deepcopy", builder=("h", "builder", ()))


def test_an_inline_site_is_found_by_its_type_call() -> None:
    source = TYPE_GLOBAL.replace("builder(modules, cache, wrapper, prefix, deepcopy)", "wrap(modules)")
    has, code_of = lookups({"m": ({"Wrapper", "deepcopy", "wrap"}, source)})
    assert _sites.shape_problem(INLINE, has, code_of) is None


def test_a_helper_site_needs_the_entry_to_call_the_helper() -> None:
    calls = "def wrap(modules):\n    builder(modules, {}, Wrapper, 'W', deepcopy)\n"
    has, code_of = lookups({"m": ({"Wrapper", "deepcopy", "wrap", "builder"}, calls),
                            "h": ({"builder"}, TYPE_GLOBAL)})
    assert _sites.shape_problem(HELPER, has, code_of) is None
    idle = "def wrap(modules):\n    pass\n"
    has, code_of = lookups({"m": ({"Wrapper", "deepcopy", "wrap", "builder"}, idle),
                            "h": ({"builder"}, TYPE_GLOBAL)})
    assert _sites.shape_problem(HELPER, has, code_of) == "wrap does not call builder"
    # The entry calls the helper by the name its own module binds: no binding, no call.
    has, code_of = lookups({"m": ({"Wrapper", "deepcopy", "wrap"}, calls), "h": ({"builder"}, TYPE_GLOBAL)})
    assert _sites.shape_problem(HELPER, has, code_of) == "no builder"


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
    has, code_of = lookups({"m": (names, source)})
    assert _sites.shape_problem(INLINE, has, code_of) == problem


def test_a_type_call_in_a_nested_function_reaches_the_global() -> None:
    source = "def wrap(m):\n    def inner():\n        return type('W', (object, m), {})\n    return inner()\n"
    has, code_of = lookups({"m": ({"Wrapper", "deepcopy", "wrap"}, source)})
    assert _sites.shape_problem(INLINE, has, code_of) is None


def test_the_start_up_names_come_from_the_table() -> None:
    assert set(_sites.WATCHED_MODULES) == {*_sites.FSDP2_PACKAGES, *(site.module for site in _sites.SITES)}
    # torch's modules are those of the sites of torch's APIs; Megatron-FSDP's is watched beside them.
    torch_sites = [site for site in _sites.SITES if _sites.distribution_of(site.api) == "torch"]
    assert set(_sites.TORCH_MODULES) == {*_sites.FSDP2_PACKAGES, *(site.module for site in torch_sites)}
    assert {site.api for site in _sites.SITES} == set(_sites.APIS)


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


# ------------------------------------------------------------------------------- a made-up site

# A torch release that moves composable DDP's construction into a helper of another module, whose
# parameters have names and an order of their own (tests/programs/made_up_site.py holds its Site row).
MADE_UP_HELPER = """
def _wrap_class(wrapper_cls, targets, name_prefix, cache, deepcopy_fn):
    for target in targets:
        cls = target.__class__
        new_cls = cache.get(cls)
        if new_cls is None:
            new_cls = type(f"{name_prefix}{cls.__name__}", (wrapper_cls, cls), {"__deepcopy__": deepcopy_fn})
            cache[cls] = new_cls
        target.__class__ = new_cls
"""
MADE_UP_REPLICATE = """
from torch.distributed._composable_state import _wrap_class


def unimplemented_deepcopy(*args, **kwargs):
    raise AssertionError("DDP does not support deepcopy")


class DDP:
    pass


def replicate(module, **kwargs):
    _wrap_class(DDP, (module,), "DDP", {}, unimplemented_deepcopy)
    return module
"""


def test_a_made_up_site_reaches_the_patch_the_probe_doctor_and_the_sweep(
    tmp_path: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One Site row is all a torch release that moves a builder needs: the row, added to the
    table, is what the hooks patch, the probe asks, doctor reads and the sweep accounts for."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site)
    fake_transformers(env.site)
    distributed = env.site / "torch" / "distributed"
    (distributed / "_composable_state.py").write_text(MADE_UP_HELPER)
    (distributed / "_composable" / "replicate.py").write_text(MADE_UP_REPLICATE)
    result = env.run_program(PROGRAMS / "made_up_site.py")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    (report,) = json_lines(result.stdout)
    status, classes = report["status"], report["classes"]
    # The probe ran the made-up helper (its arguments matched by the row's names).
    assert report["resolved"] and report["probe"] in (_patch.TORCH_REFUSED, _patch.TORCH_ACCEPTED)
    if report["probe"] == _patch.TORCH_REFUSED:  # CPython 3.9 - 3.14: patched through the new helper
        assert status["applied"] and status["sites"] == [f"{_sites.DDP_MODULE}.replicate"], status
        assert classes["Head"] == {"name": "DDPHead", "is_wrapper": True, "torch_bases": False}
    else:  # CPython 3.15+: torch's class, left alone
        assert not status["applied"] and classes["Head"]["torch_bases"], status
    assert classes["Plain"] == {"name": "DDPPlain", "is_wrapper": True, "torch_bases": True}
    doctor = report["doctor"]
    assert doctor["known"] is True and doctor["text"].endswith("_composable_state._wrap_class"), doctor
    # The sweep: the helper's class swap is unaccounted for without the row, and covered with it.
    swaps = class_swaps(env.site / "torch")
    assert ("distributed/_composable_state.py", "_wrap_class") in {swap[:2] for swap in unaccounted(swaps)}
    made_up = _sites.Site(_sites.DDP_REPLICATE, (2, 13), _sites.DDP_MODULE, "replicate", ("DDP",), "DDP",
                          "unimplemented_deepcopy", builder=("torch.distributed._composable_state",
                                                             "_wrap_class", ()))
    monkeypatch.setattr(_sites, "SITES", (made_up, *_sites.SITES))
    assert unaccounted(swaps) == []


# A made-up release's new API in a module of its own (tests/programs/made_up_api.py holds its rows).
MADE_UP_MODULE = """
def _unimplemented_deepcopy(*args, **kwargs):
    raise AssertionError("does not support deepcopy")


class MadeModule:
    pass


cls_to_made_cls = {}


def wrap(module):
    cls = module.__class__
    new_cls = cls_to_made_cls.get(cls)
    if new_cls is None:
        new_cls = type(f"Made{cls.__name__}", (MadeModule, cls), {"__deepcopy__": _unimplemented_deepcopy})
        cls_to_made_cls[cls] = new_cls
    module.__class__ = new_cls
    return module
"""


def test_a_new_api_is_rows_reaching_the_patch_the_probe_doctor_and_the_sweep(
    tmp_path: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new API, as CONTRIBUTING's recipe adds it (its name in APIS, its Site row, its module
    watched): the hooks patch it, the probe asks it, doctor reads it and the sweep accounts for it,
    with no other change to the package."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site)
    fake_transformers(env.site)
    (env.site / "torch" / "distributed" / "_composable" / "test_only_made_up.py").write_text(MADE_UP_MODULE)
    result = env.run_program(PROGRAMS / "made_up_api.py")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    (report,) = json_lines(result.stdout)
    status, classes = report["status"], report["classes"]
    assert report["resolved"] and report["probe"] in (_patch.TORCH_REFUSED, _patch.TORCH_ACCEPTED)
    if report["probe"] == _patch.TORCH_REFUSED:  # CPython 3.9 - 3.14
        assert "torch.distributed._composable.test_only_made_up.wrap" in status["sites"], status
        assert classes["Head"] == {"name": "MadeHead", "is_wrapper": True, "torch_bases": False}
    else:  # CPython 3.15+: torch's class, left alone
        assert classes["Head"]["torch_bases"], classes
    assert classes["Plain"] == {"name": "MadePlain", "is_wrapper": True, "torch_bases": True}
    assert report["doctor"]["known"] is True, report["doctor"]
    swaps = class_swaps(env.site / "torch")
    found = {swap[:2] for swap in unaccounted(swaps)}
    assert ("distributed/_composable/test_only_made_up.py", "wrap") in found
    monkeypatch.setattr(_sites, "SITES", (*_sites.SITES, _sites.Site(
        "test-only made-up wrap", (2, 99), "torch.distributed._composable.test_only_made_up", "wrap",
        ("MadeModule",), "Made", "_unimplemented_deepcopy", "cls_to_made_cls")))
    assert unaccounted(swaps) == []
