"""What a process sees of torch with the package installed, to compare with ``FSDP_AUTOPATCH=0``.

    python tests/programs/invisible.py torch-alone     # names, leftovers, lifetimes, class hooks, threads
    python tests/programs/invisible.py undone          # the status after a reload of torch's module
    python tests/programs/invisible.py compile BACKEND [BACKEND ...]  # a compatible class beside its
                                                             # ABC-last twin, under torch.compile

Each part prints one JSON object; tests/test_invisible.py runs them with the package on and with
``FSDP_AUTOPATCH=0`` and compares. Real torch, transformers and a 1-rank gloo group on the CPU.
"""

from __future__ import annotations

import abc
import builtins
import gc
import importlib
import inspect
import json
import sys
import threading
import types
import typing
import weakref
from typing import Any, Callable

import torch
import torch.distributed.fsdp  # FSDP2, and composable DDP through it
import transformers  # noqa: F401 (an affected release arms the patch in auto mode)
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_autopatch
from fsdp_autopatch import DDP_MODULE, _sites, _verify

try:  # FSDP2 replicate, torch 2.9+
    import torch.distributed._composable.replicate_with_fsdp
except ImportError:
    pass

LAYOUT_ERROR = _verify.LAYOUT_ERROR
# The package torch.distributed._composable binds the function replicate under the submodule's name.
ddp_module = sys.modules[DDP_MODULE]
WRAPPERS = (FSDPModule, ddp_module.DDP)


def site_modules() -> list[str]:
    """Every torch module a site of the package names, that this torch has loaded."""
    names = {name for site in _sites.SITES for name in (site.module, site.builder_module)}
    return sorted(name for name in names if name in sys.modules)


def describe(value: Any) -> str:
    """A value as another process can compare it: what it is, not where it lives."""
    if value is builtins.type:
        return "builtins.type"
    kind = type(value).__qualname__
    return f"{kind} {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"


def what_users_read(name: str) -> dict[str, Any]:
    """What code outside torch's builder reads of a module: its public names, a star import,
    ``eval`` of ``type`` there, and its functions' annotations and signatures as evaluated."""
    module = sys.modules[name]
    star: dict[str, Any] = {}
    exec(f"from {name} import *", star)
    hints, signatures = {}, {}
    for attribute, value in sorted(vars(module).items()):
        if inspect.isfunction(value) and value.__module__ == name:
            try:
                hints[attribute] = {k: repr(v) for k, v in typing.get_type_hints(value).items()}
            except Exception as error:  # as torch alone raises it
                hints[attribute] = type(error).__name__
            try:
                signatures[attribute] = str(inspect.signature(value, eval_str=True))
            except Exception as error:
                signatures[attribute] = type(error).__name__
    return {
        "names": {k: describe(v) for k, v in sorted(vars(module).items()) if not k.startswith("_")},
        "star": sorted((k, describe(v)) for k, v in star.items() if k != "__builtins__"),
        "eval_type": describe(eval("type", vars(module))),
        "binds_type": "type" in vars(module),
        "hints": hints,
        "signatures": signatures,
    }


def subclasses(root: type) -> list[str]:
    """Every class below ``root``, by module and name, after a collection."""
    gc.collect()
    seen, stack = set(), [root]
    while stack:
        for cls in stack.pop().__subclasses__():
            if cls not in seen:
                seen.add(cls)
                stack.append(cls)
    return sorted(f"{cls.__module__}.{cls.__qualname__}" for cls in seen)


def held_by_module(module: types.ModuleType) -> set[int]:
    """The classes a module holds for good: its globals, the items of a tuple among them (the
    start-up module's hand-over loaders, built on first use), and their bases."""
    held: set[int] = set()
    for value in vars(module).values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, type):
                held.update(id(cls) for cls in item.__mro__)
    return held


def own_classes_alive() -> list[str]:
    """Classes the package made at run time (its probe and self-check classes, and what torch
    built from them) still alive after a collection; the classes its modules hold aside."""
    gc.collect()
    held = {name: held_by_module(module) for name, module in list(sys.modules.items())
            if name.startswith("fsdp_autopatch") and module is not None}
    found = []
    for value in gc.get_objects():
        if not isinstance(value, type):
            continue
        module = value.__dict__.get("__module__")
        if isinstance(module, str) and module.startswith("fsdp_autopatch") and \
                id(value) not in held.get(module, ()):
            found.append(f"{module}.{value.__qualname__}")
    return sorted(found)


def wrap(wrapper: Callable[..., Any], module: nn.Module, mesh: Any) -> str:
    """Wrap ``module``; what happened, in a word."""
    try:
        if wrapper is fully_shard:
            fully_shard(module, mesh=mesh)
        else:
            replicate(module)
    except TypeError as error:
        return "layout" if LAYOUT_ERROR in str(error) else f"TypeError: {error}"
    return "wrapped"


def lifetimes(wrapper: Callable[..., Any], mesh: Any, first: tuple[type, ...]) -> dict[str, Any]:
    """20 classes made in a function, one module each, wrapped then dropped: how many classes
    (originals and the classes their modules got) are alive after a collection."""
    refs, outcomes = [], set()
    for index in range(20):
        made = type(f"Made{index}", (*first, nn.Linear), {})
        module = made(2, 2)
        outcomes.add(wrap(wrapper, module, mesh))
        refs += [weakref.ref(made), weakref.ref(type(module))]
        del made, module
    if wrapper is fully_shard:
        from torch.distributed.fsdp._fully_shard._fully_shard import cls_to_fsdp_cls

        cls_to_fsdp_cls.clear()  # FSDP2's cache keeps its classes, with or without the package
    gc.collect()
    return {"outcomes": sorted(outcomes), "alive": sum(ref() is not None for ref in refs)}


class Spawning:
    """A user's empty-slots base whose class hook starts a thread that wraps another module,
    and waits for it."""

    __slots__ = ()
    wrapper: Callable[..., Any] = replicate
    mesh: Any = None
    joined: list[bool] = []  # noqa: RUF012

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__.startswith(("DDP", "FSDP")) and not Spawning.joined:
            worker = threading.Thread(target=wrap, args=(Spawning.wrapper, nn.Linear(2, 2), Spawning.mesh),
                                      daemon=True)
            worker.start()
            worker.join(timeout=60)
            Spawning.joined.append(not worker.is_alive())


class Registry:
    """A user's empty-slots base that keeps a registry of its subclasses."""

    __slots__ = ()
    names: list[str] = []  # noqa: RUF012

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Registry.names.append(cls.__name__)


def torch_alone() -> dict[str, Any]:
    mesh = _verify.init_process_group()
    report: dict[str, Any] = {"status": fsdp_autopatch.status().applied}
    # Armed (and, in auto mode, patched and self-checked) by the imports above; nothing wrapped.
    report["modules"] = {name: what_users_read(name) for name in site_modules()}
    report["subclasses"] = {cls.__name__: subclasses(cls) for cls in (nn.Module, *WRAPPERS)}
    report["own_classes"] = own_classes_alive()
    report["lifetimes"] = {
        f"{wrapper.__name__} {kind}": lifetimes(wrapper, mesh, first)
        for wrapper in (replicate, fully_shard) for kind, first in (("plain", ()), ("abc", (abc.ABC,)))
    }
    registry_outcomes = []
    for wrapper in (replicate, fully_shard):
        Registry.names.clear()

        class RegisteredHead(Registry, nn.Linear):
            pass

        registry_outcomes.append((wrap(wrapper, RegisteredHead(2, 2), mesh), sorted(set(Registry.names))))
    report["registry"] = registry_outcomes
    hooks = []
    for wrapper in (replicate, fully_shard):
        Spawning.wrapper, Spawning.mesh = wrapper, mesh
        Spawning.joined.clear()

        class SpawningHead(Spawning, nn.Linear):
            pass

        hooks.append((wrap(wrapper, SpawningHead(2, 2), mesh), list(Spawning.joined)))
    report["hooks"] = hooks
    return report


def undone() -> dict[str, Any]:
    mesh = _verify.init_process_group()

    class Head(abc.ABC, nn.Linear):
        pass

    before = fsdp_autopatch.status()
    first = wrap(replicate, Head(2, 2), mesh)
    reloaded = importlib.reload(ddp_module)
    after = fsdp_autopatch.status()
    # torch's own reloaded replicate() no longer works on the CPU (its state registry is the old
    # function's); what matters is that its builder is torch's code again, which the status says.
    builder = inspect.unwrap(reloaded.replicate)
    return {"before": [before.applied, list(before.sites)], "first": first,
            "after": [after.applied, list(after.sites), after.reason],
            "reloaded_builder_redirected": "_fsdp_autopatch_type" in builder.__code__.co_names}


def attempt(call: Callable[[], Any]) -> tuple[Any, str]:
    """What ``call`` returns, and "ok" or the class of the exception it raised."""
    try:
        return call(), "ok"
    except Exception as error:
        return None, type(error).__name__


def compiled(function: Callable[..., Any], backend: str, x: Any) -> dict[str, Any]:
    """``function`` eagerly and under torch.compile: what fullgraph gives, the graphs and breaks
    dynamo counts, whether a second call with the same shape compiled again, and whether the
    compiled results equal the eager one."""
    import torch._dynamo

    eager, eager_outcome = attempt(lambda: function(x))
    torch._dynamo.reset()
    full, fullgraph = attempt(lambda: torch.compile(function, fullgraph=True, backend=backend)(x))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    once = torch.compile(function, backend=backend)
    first, first_outcome = attempt(lambda: once(x))
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    second, second_outcome = attempt(lambda: once(x))
    results = [r for r in (full, first, second) if r is not None]
    return {
        "eager": eager_outcome, "fullgraph": fullgraph, "compiled": [first_outcome, second_outcome],
        "graphs": graphs, "graph_breaks": breaks,
        "recompiled": counters["stats"]["unique_graphs"] - graphs,
        "equal_to_eager": eager is not None and all(torch.equal(eager, r) for r in results),
    }


def compile_twins(backend: str, mesh: Any) -> dict[str, Any]:
    """A compatible class (``ABC`` first) beside its twin with ``ABC`` last, which torch wraps
    unaided: slicing the container, forward, and a step that turns gradient sync off."""
    report: dict[str, Any] = {}
    for wrapper in (replicate, fully_shard):
        for twin, bases in (("abc_first", (abc.ABC, nn.Sequential)), ("abc_last", (nn.Sequential, abc.ABC))):
            torch.manual_seed(0)
            model = type(f"Stack{twin}", bases, {})(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
            outcome = wrap(wrapper, model, mesh)
            x = torch.randn(2, 4)

            def sliced(x: Any, model: Any = model) -> Any:
                return model[0:2](x)

            def step(x: Any, model: Any = model) -> Any:
                model.set_requires_gradient_sync(False)
                return model(x)

            report[f"{wrapper.__name__} {twin}"] = {
                "wrapped": outcome,
                "class": "torch's" if type(model).__bases__[0] in WRAPPERS else "compatible",
                "slice": compiled(sliced, backend, x), "forward": compiled(model, backend, x),
                "sync_step": compiled(step, backend, x),
                # A monkeypatch of the wrapper class reaches the module.
                "monkeypatch": monkeypatch_reaches(model),
            }
    return report


def monkeypatch_reaches(model: Any) -> bool:
    wrapper = next(cls for cls in type(model).__mro__ if cls in WRAPPERS)
    original = wrapper.__dict__["set_requires_gradient_sync"]
    wrapper.set_requires_gradient_sync = lambda self, value: "monkeypatched"
    try:
        return model.set_requires_gradient_sync(True) == "monkeypatched"
    finally:
        wrapper.set_requires_gradient_sync = original


def main(argv: list[str]) -> int:
    part = argv[0]
    if part == "compile":
        mesh = _verify.init_process_group()
        report = {backend: compile_twins(backend, mesh) for backend in argv[1:]}
    else:
        report = torch_alone() if part == "torch-alone" else undone()
    print(json.dumps(report, sort_keys=True))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
