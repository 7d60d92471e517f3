"""The proof, run for real: wrap tiny transformers models with FSDP2 and composable DDP on gloo.

``python -m fsdp_autopatch._verify [RUN ...]`` is one rank, a fresh interpreter armed as a
training process is (a launcher's variables from the environment; alone, a group of one). Per
run, rank 0 prints one JSON line: the class torch built, its losses next to an unwrapped copy's,
or the error; then every rank prints the classes the patch built there. ``grade`` turns the
lines into pass or fail. Importing this module imports nothing beyond the standard library.
"""

from __future__ import annotations

import atexit
import copy
import functools
import gc
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from fsdp_autopatch._console import EXIT_CANNOT_TELL, EXIT_OK
from fsdp_autopatch._sites import DDP_MODULE

# The three transformers heads that inherit abc.ABC in the affected releases (_matrix), and a
# causal LM of the same family, which never needs the patch: what torch's own class does here,
# the control every other run of the same wrapper is graded against.
MODELS = {
    "token-classification": "AutoModelForTokenClassification",
    "sequence-classification": "AutoModelForSequenceClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "causal-lm": "AutoModelForCausalLM",
}
CONTROL = "causal-lm"
# A model runs under FSDP2's fully_shard, then under composable DDP's replicate, named so.
DDP_SUFFIX = " (DDP)"
# CPython's words when it refuses the class swap: the bug itself, as torch raises it.
LAYOUT_ERROR = "object layout differs"
# Wrapped and unwrapped copies see the same weights and batches: anything above rounding noise
# means the wrapped model computes something different.
LOSS_TOLERANCE = 1e-4
VOCABULARY, BATCH, SEQUENCE, STEPS = 128, 2, 8, 2


def tiny_config() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0,
        classifier_dropout=0.0,  # no dropout: both copies must compute the same losses
    )


def build_model(kind: str) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, MODELS[kind]).from_config(tiny_config())


def make_batch(kind: str, step: int) -> dict[str, Any]:
    """The same batch on every rank, so wrapped and unwrapped training see the same data."""
    import torch

    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCABULARY, (BATCH, SEQUENCE), generator=generator)
    if kind == "token-classification":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (BATCH, SEQUENCE), generator=generator)}
    if kind == "sequence-classification":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (BATCH,), generator=generator)}
    if kind == "question-answering":
        positions = torch.randint(0, SEQUENCE, (2, BATCH), generator=generator)
        return {"input_ids": ids, "start_positions": positions[0], "end_positions": positions[1]}
    return {"input_ids": ids, "labels": ids}


def describe_class(cls: type) -> dict[str, Any]:
    """What makes two wrapper classes the same: name, bases, metaclass, MRO, own attributes."""
    return {
        "name": cls.__name__,
        "bases": [f"{base.__module__}.{base.__qualname__}" for base in cls.__bases__],
        "metaclass": f"{type(cls).__module__}.{type(cls).__qualname__}",
        "mro": [f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__],
        "namespace": sorted(cls.__dict__),
    }


def fsdp2() -> Any:
    """torch's FSDP2 package as users import it: that of the newest fully_shard site this release
    may have (torch 2.6+: torch.distributed.fsdp; 2.4 and 2.5: torch.distributed._composable.fsdp)."""
    import torch

    from fsdp_autopatch import _matrix, _sites

    sites = _sites.sites_of(_sites.FULLY_SHARD, _matrix.release(torch.__version__))
    if not sites:
        raise ImportError(f"torch {torch.__version__} has no FSDP2 fully_shard")
    return importlib.import_module(sites[0].package)


def runs(kinds: Iterable[str]) -> list[str]:
    """The runs of these models: each with fully_shard, then each with composable DDP."""
    kinds = list(kinds)
    return [*kinds, *(kind + DDP_SUFFIX for kind in kinds)]


def run_kind(run: str) -> tuple[str, bool]:
    """The model of a run, and whether the run replicates it with composable DDP."""
    ddp = run.endswith(DDP_SUFFIX)
    return (run[: -len(DDP_SUFFIX)] if ddp else run), ddp


def shard_and_train(run: str, mesh: Any, steps: int = STEPS) -> dict[str, Any]:
    """Wrap the run's model (FSDP2: each decoder layer, then the root; composable DDP: the
    root), then train it next to an unwrapped copy."""
    import torch

    kind, ddp = run_kind(run)
    if ddp:  # the module, not the function of that name torch.distributed._composable exports
        composable = importlib.import_module(DDP_MODULE)
        wrapper, wrap = composable.DDP, composable.replicate
    else:
        fsdp = fsdp2()
        wrapper, wrap = fsdp.FSDPModule, functools.partial(fsdp.fully_shard, mesh=mesh)

    started = time.perf_counter()
    model = build_model(kind)
    original, reference = type(model), copy.deepcopy(model)
    result: dict[str, Any] = {"model": run}
    try:
        for module in ([] if ddp else list(model.base_model.layers)) + [model]:
            wrap(module)
    except TypeError as error:
        return dict(result, sharded=False, error=str(error), seconds=time.perf_counter() - started)
    result.update(
        sharded=True,
        wrapper=describe_class(type(model)),
        is_fsdp_module=isinstance(model, wrapper),
        # torch's own construction: type(f"FSDP{name}", (FSDPModule, cls), ...), DDP likewise
        upstream_bases=type(model).__bases__ == (wrapper, original),
        original_at_mro_2=type(model).__mro__[2] is original,
        layer_wrapper=type(model.base_model.layers[0]).__name__,
    )
    losses: dict[Any, list[float]] = {model: [], reference: []}
    optimizers = {net: torch.optim.SGD(net.parameters(), lr=0.1) for net in losses}
    try:
        for step in range(steps):
            for net, optimizer in optimizers.items():
                loss = net(**make_batch(kind, step)).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[net].append(loss.item())
    except RuntimeError as error:
        # torch 2.4's FSDP2 creates CUDA streams on first forward, whatever the mesh's device, so
        # without a GPU it cannot train any model; the class it built is still worth reporting.
        return dict(result, trained=False, train_error=str(error).splitlines()[0],
                    seconds=time.perf_counter() - started)
    return dict(result, trained=True, losses=losses[model], reference_losses=losses[reference],
                max_loss_difference=max(abs(a - b) for a, b in zip(losses[model], losses[reference])),
                seconds=time.perf_counter() - started)


# What one run showed. The wrapped outcomes go from best to worst.
TRAINED = "trained"  # every loss matched the unwrapped copy's
DRIFTED = "drifted"  # the first loss matched (same forward pass), a later one did not
DIVERGED = "diverged"  # the first loss already differed
UNTRAINED = "untrained"  # wrapped, but this torch could not run a train step
SHARDED_OUTCOMES = (TRAINED, DRIFTED, DIVERGED, UNTRAINED)
LAYOUT = "layout"  # the wrapper raised the layout error: the bug
SHARD_FAILED = "shard failed"  # the wrapper raised something else
ABSENT = "absent"  # no result


def outcome(result: Optional[Mapping[str, Any]]) -> str:
    """One word for a run's result line."""
    if result is None:
        return ABSENT
    if not result.get("sharded"):
        return LAYOUT if LAYOUT_ERROR in str(result.get("error", "")) else SHARD_FAILED
    if result.get("trained") is False:
        return UNTRAINED
    difference = result.get("max_loss_difference")
    if not isinstance(difference, (int, float)) or difference <= LOSS_TOLERANCE:
        return TRAINED
    losses, reference = result.get("losses") or [None], result.get("reference_losses") or [None]
    if isinstance(losses[0], (int, float)) and isinstance(reference[0], (int, float)) \
            and abs(losses[0] - reference[0]) <= LOSS_TOLERANCE:
        return DRIFTED
    return DIVERGED


@dataclass(frozen=True)
class Grade:
    outcomes: dict[str, str]
    ok: dict[str, bool]
    control: str  # the FSDP2 control's outcome; ABSENT when it did not run


def grade(results: Mapping[str, Mapping[str, Any]]) -> Grade:
    """Pass or fail per run: it passes when it wrapped and trained at least as well as the control
    run of the same wrapper (torch 2.4 and 2.5 cannot train FSDP2 on a CPU, and torch 2.8 on two gloo
    ranks updates differently from one process, for torch's own classes too). Without a control,
    only exact training passes."""
    outcomes = {run: outcome(result) for run, result in results.items()}

    def tolerated(run: str) -> tuple[str, ...]:
        control = outcomes.get(CONTROL + DDP_SUFFIX if run_kind(run)[1] else CONTROL, ABSENT)
        worst = SHARDED_OUTCOMES.index(control) if control in SHARDED_OUTCOMES else 0
        return SHARDED_OUTCOMES[:worst + 1]

    ok = {run: seen in tolerated(run) for run, seen in outcomes.items()}
    return Grade(outcomes, ok, outcomes.get(CONTROL, ABSENT))


def init_process_group() -> Any:
    """Join (or, alone, form) the gloo group a launcher's environment variables describe."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo")
    # The models' reference cycles hold gloo's finished work. Left to the interpreter's final
    # collection, a gloo thread freeing it takes the GIL, is ended by the finalizing interpreter
    # and aborts the rank ("terminate called without an active exception";
    # https://github.com/pytorch/pytorch/pull/179291). atexit runs while the interpreter is whole.
    atexit.register(gc.collect)
    return init_device_mesh("cpu", (dist.get_world_size(),))


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def missing_prerequisite() -> Optional[str]:
    """Why this interpreter cannot run the proof, in one line, or None when it can. Imports
    torch's FSDP2, then transformers: with transformers, FSDP2 is what the patch waits for."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as error:
        return f"torch cannot be imported ({one_line(error)}); install torch 2.4 or newer"
    for available, what in (("is_available", "torch.distributed"), ("is_gloo_available", "gloo")):
        if not getattr(dist, available)():
            return (f"torch {torch.__version__} was built without {what}; install a build that has it (the "
                    "PyPI wheels do)")
    try:
        fsdp2()
    except ImportError as error:
        return (f"torch {torch.__version__} has no FSDP2 fully_shard ({one_line(error)}); it came in "
                "torch 2.4, and older torch has nothing to patch")
    try:
        from transformers import Qwen2Config  # noqa: F401  (the tiny models are Qwen2)
    except Exception as error:
        return (f"transformers with Qwen2 models cannot be imported ({one_line(error)}); "
                "install transformers 4.37 or newer")
    return None


def one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0] if text else type(error).__name__


def say(record: dict[str, Any]) -> None:
    """One JSON line on stdout, which verify reads (a rank's own file there)."""
    print(json.dumps(record), flush=True)


def main(argv: list[str]) -> int:
    """Exit 0 once the proof ran (whatever it found), 2 when it cannot run here (saying why)."""
    kinds = argv or runs(MODELS)
    problem = missing_prerequisite()
    if problem is None:
        import torch.distributed as dist

        import fsdp_autopatch

        try:
            mesh = init_process_group()
        except Exception as error:
            problem = (f"the gloo process group did not form ({one_line(error)}); check that MASTER_ADDR "
                       "and MASTER_PORT are reachable from every rank")
    if problem is not None:
        say({"cannot_run": problem})
        print(f"cannot verify: {problem}", file=sys.stderr)
        return EXIT_CANNOT_TELL
    rank = dist.get_rank()
    try:
        if rank == 0:
            say({"status": fsdp_autopatch.status().to_dict()})
        for kind in kinds:
            result = shard_and_train(kind, mesh)
            if rank == 0:
                say(result)
        # Every rank builds its own classes, and says which.
        status = fsdp_autopatch.status().to_dict()
        say({"rank": rank, "classes": status["classes"], "classes_seen": status["classes_seen"]})
        # No rank tears gloo down while another still uses it: gloo aborts the process then.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
