"""The torch side of the benchmarks, run by ``run.py`` in the environment under test.

    python benchmarks/bench_torch.py shard --kinds causal-lm,abc-causal-lm --reps 6 --steps 20
    python benchmarks/bench_torch.py classes --instances 64
    python benchmarks/bench_torch.py first-trip --classes 40

Each run is one fresh process (the patch is per process: it is the installed ``.pth`` and
``FSDP_AUTOPATCH`` that decide, as for a user), one gloo rank on the CPU, and prints one JSON
object on its last line. Models, batches and the process group come from
``fsdp_autopatch._verify``, the package's own proof, so the benchmark shards what it verifies.
"""

from __future__ import annotations

import abc
import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any, Callable

# torch is imported in the order a training script does, before anything of ours.
import torch
import torch.distributed as dist
import torch.distributed.fsdp
import transformers

import fsdp_autopatch
from fsdp_autopatch import _verify


class AbcHead(abc.ABC):  # noqa: B024  (like transformers' Generic*For* heads: no abstract methods)
    """An empty-``__slots__`` base that adds ``__dict__`` on ``ABC``: the shape of the bug."""


class AbcQwen2ForCausalLM(AbcHead, transformers.Qwen2ForCausalLM):
    """The causal LM with an ABC head mixed in ahead: the same computation, but it needs the
    patch to be sharded, so its cost against ``Qwen2ForCausalLM`` is the patch's alone."""


def build(kind: str) -> Any:
    if kind == "abc-causal-lm":
        torch.manual_seed(0)
        return AbcQwen2ForCausalLM(_verify.tiny_config())
    return _verify.build_model(kind)


def batch_kind(kind: str) -> str:
    return "causal-lm" if kind == "abc-causal-lm" else kind


def shard(model: Any, mesh: Any) -> float:
    """Shard every decoder layer, then the root, as ``_verify.shard_and_train`` does; seconds."""
    fully_shard = torch.distributed.fsdp.fully_shard
    started = time.perf_counter()
    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return time.perf_counter() - started


def step_times(model: Any, kind: str, warmup: int, steps: int) -> list[float]:
    """Seconds per training step (forward, backward, SGD step), each timed on its own."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for step in range(warmup + steps):
        batch = _verify.make_batch(batch_kind(kind), step)
        started = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return times


def shard_benchmark(kinds: list[str], reps: int, warmup: int, steps: int, mesh: Any) -> dict[str, Any]:
    """Per kind and repetition: fully_shard seconds and median step seconds of a fresh model.

    Kinds are interleaved within each repetition so that their comparison is paired in time.
    Repetition 0 is dropped: it pays for the first fully_shard in the process (lazy imports,
    process-group warm-up, building the wrapper classes), which ``classes`` measures instead.
    """
    results: dict[str, dict[str, Any]] = {kind: {"shard": [], "step": []} for kind in kinds}
    for rep in range(reps + 1):
        for kind in kinds:
            model = build(kind)
            results[kind]["abc_in_mro"] = abc.ABC in type(model).__mro__
            shard_seconds = shard(model, mesh)
            step_seconds = statistics.median(step_times(model, kind, warmup, steps))
            if rep > 0:
                results[kind]["shard"].append(shard_seconds)
                results[kind]["step"].append(step_seconds)
            del model
    return results


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class AbcBlock(AbcHead, Block):
    """A user's own ABC module class; needs the patch whatever the transformers version."""


class OwnReshard(abc.ABC):  # noqa: B024
    """An empty-``__slots__`` base with a method FSDPModule defines too: a module whose class puts
    it first gets a mirror that must resolve ``reshard`` to FSDPModule's, as torch's MRO does."""

    __slots__ = ()

    def reshard(self) -> None:
        raise AssertionError("FSDPModule's reshard must win")


# How many times one module's attribute is looked up per sample.
ACCESSES = 20_000


def access_seconds(module: Any, name: str) -> float:
    """Seconds per ``getattr(module, name)``, the loop included (the same on both sides)."""
    started = time.perf_counter()
    for _ in range(ACCESSES):
        getattr(module, name)
    return (time.perf_counter() - started) / ACCESSES


class WarmupBlock(Block):
    """Sharded first and not reported: the first fully_shard in a process pays one-off costs."""


def subclasses(cls: type) -> list[type]:
    found, stack = [], [cls]
    while stack:
        for sub in stack.pop().__subclasses__():
            found.append(sub)
            stack.append(sub)
    return found


def classes_benchmark(instances: int, models: int, mesh: Any) -> dict[str, Any]:
    """Shard many modules of one class; count the wrapper classes that exist afterwards.

    A wrapper class is counted however it was made (``FSDPModule.__subclasses__`` walked
    recursively, by name), not only through the cache, so a class built and then not cached
    would show up too.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fully_shard

    fully_shard = torch.distributed.fsdp.fully_shard
    report: dict[str, Any] = {}
    groups: dict[str, tuple[Callable[[], Any], Callable[[Any], list[Any]], int]] = {
        # name: (make one instance, the modules it shards, how many instances)
        "AbcBlock": (AbcBlock, lambda module: [module], instances),
        "Block": (Block, lambda module: [module], instances),
        "Qwen2ForTokenClassification": (
            lambda: _verify.build_model("token-classification"),
            lambda model: [model, *model.base_model.layers], models,
        ),
    }
    fully_shard(WarmupBlock(), mesh=mesh)
    for name, (make, watched, count) in groups.items():
        wrappers: dict[type, set[type]] = {}  # original class -> wrapper classes seen
        seconds = []
        sharded = 0
        for _ in range(count):
            module = make()
            before = [(item, type(item)) for item in watched(module)]
            started = time.perf_counter()
            if isinstance(module, transformers.PreTrainedModel):
                shard(module, mesh)
            else:
                fully_shard(module, mesh=mesh)
            seconds.append(time.perf_counter() - started)
            sharded += len(before)
            for item, original in before:
                wrappers.setdefault(original, set()).add(type(item))
        # Classes alive, not garbage awaiting a collection (a class a construction hook refused
        # lingers in a reference cycle until the collector runs).
        gc.collect()
        existing = subclasses(FSDPModule)
        report[name] = {
            "instances": count,
            "modules_sharded": sharded,
            "original_classes": sorted(cls.__name__ for cls in wrappers),
            "abc_in_mro": any(abc.ABC in cls.__mro__ for cls in wrappers),
            # The claim: one wrapper class per original class, however many modules share it.
            "max_wrapper_classes_per_original": max(len(seen) for seen in wrappers.values()),
            "max_wrapper_classes_in_existence_per_original": max(
                sum(1 for c in existing if c.__name__ == f"FSDP{cls.__name__}") for cls in wrappers
            ),
            "max_cache_entries_per_original": max(
                sum(1 for key in _fully_shard.cls_to_fsdp_cls if key is cls) for cls in wrappers
            ),
            "first_fully_shard_seconds": seconds[0],
            "later_fully_shard_median_seconds": statistics.median(seconds[1:]) if count > 1 else None,
        }
    from fsdp_autopatch import _wrapper_cls

    report["layout_mirror_classes"] = len(_wrapper_cls._mirrors)
    report["cache_type"] = type(_fully_shard.cls_to_fsdp_cls).__name__
    return report


def first_trip_benchmark(count: int, mesh: Any) -> dict[str, Any]:
    """Seconds of the first ``fully_shard`` of each of ``count`` new classes, plain and ABC.

    A class's first trip through the construction site is where the patch does its work: it
    asks CPython whether torch's class fits, records the class, and for an ABC class builds a
    compatible one. Later modules of the same class are cache hits, which ``classes`` measures.
    Unpatched, the ABC classes fail, so they are sharded only when the patch is applied. Patched,
    it also times looking up a method that the module's class shadows on a compatible class.
    """
    fully_shard = torch.distributed.fsdp.fully_shard
    abc_too = fsdp_autopatch.status().applied
    fully_shard(WarmupBlock(), mesh=mesh)
    times: dict[str, list[float]] = {"plain": [], "abc": [], "builder abc": [], "builder twin": [],
                                     "shadowed abc": [], "shadowed twin": []}
    for index in range(count):
        kinds = {"plain": (Block,), "abc": (AbcHead, Block)} if abc_too else {"plain": (Block,)}
        for kind, bases in kinds.items():
            # A new class each time, so every call is a cache miss, as a model's first shard is.
            module = type(f"{kind.title()}Trip{index}", bases, {})()
            started = time.perf_counter()
            fully_shard(module, mesh=mesh)
            times[kind].append(time.perf_counter() - started)
        if abc_too:
            # torch's builder alone, a class that needs the fix against its ABC-last twin: what
            # the patch adds to building one class, without fully_shard's own work around it.
            for kind, bases in (("builder abc", (AbcHead, Block)), ("builder twin", (Block, AbcHead))):
                module = type(f"Built{index}", bases, {})()
                started = time.perf_counter()
                build_wrapper_class(module)
                times[kind].append(time.perf_counter() - started)
            # A method both the module's class and FSDPModule define, looked up on a wrapped
            # module: where the mirror resolves it to FSDPModule's, against the ABC-last twin.
            shadowing = (("shadowed abc", (OwnReshard, Block)), ("shadowed twin", (Block, OwnReshard)))
            for kind, bases in shadowing:
                module = type(f"Shadowed{index}", bases, {})()
                fully_shard(module, mesh=mesh)
                times[kind].append(access_seconds(module, "reshard"))
    return times


def build_wrapper_class(module: Any) -> None:
    """torch 2.11+'s shared builder, called as fully_shard calls it, with a cache of its own."""
    from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

    _fsdp_init._apply_to_module((module,), {}, _fully_shard.FSDPModule, "FSDP",
                                _fully_shard._unimplemented_deepcopy)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    shard_parser = commands.add_parser("shard")
    shard_parser.add_argument("--kinds", default="causal-lm")
    shard_parser.add_argument("--reps", type=int, default=5)
    shard_parser.add_argument("--warmup", type=int, default=2)
    shard_parser.add_argument("--steps", type=int, default=20)
    classes_parser = commands.add_parser("classes")
    classes_parser.add_argument("--instances", type=int, default=64)
    classes_parser.add_argument("--models", type=int, default=8)
    first_trip_parser = commands.add_parser("first-trip")
    first_trip_parser.add_argument("--classes", type=int, default=40)
    options = parser.parse_args(argv)

    # One thread: per-op timings of tiny models on 2 cores are otherwise dominated by
    # intra-op thread scheduling, which is noise for every comparison made here.
    torch.set_num_threads(1)
    status = fsdp_autopatch.status().to_dict()
    mesh = _verify.init_process_group()
    try:
        if options.command == "shard":
            kinds = options.kinds.split(",")
            result = shard_benchmark(kinds, options.reps, options.warmup, options.steps, mesh)
        elif options.command == "first-trip":
            result = first_trip_benchmark(options.classes, mesh)
        else:
            result = classes_benchmark(options.instances, options.models, mesh)
    finally:
        dist.destroy_process_group()
    print(json.dumps({
        "status": status,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "result": result,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
