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
from conftest import site_packages

from fsdp_autopatch import _sites

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


def test_a_new_class_swap_in_torch_fails_the_sweep(tmp_path: Path) -> None:
    torch_dir = tmp_path / "torch"
    (torch_dir / "distributed" / "_composable").mkdir(parents=True)
    (torch_dir / "distributed" / "_composable" / "replicate.py").write_text(
        "def replicate(module):\n    module.__class__ = type('DDPX', (DDP, module.__class__), {})\n")
    (torch_dir / "distributed" / "new_wrapper.py").write_text(
        "def wrap(module):\n    setattr(module, '__class__', type('NewX', (New, type(module)), {}))\n")
    assert unaccounted(class_swaps(torch_dir)) == [("distributed/new_wrapper.py", "wrap", 2)]
