"""replicate() (``torch.distributed._composable.replicate_with_fsdp``, on the torch releases of
``_matrix.REPLICATE_ROW``) with the installed patch, on real torch and transformers, in fresh
interpreters on a gloo CPU group.

replicate() builds ``Replicate<Name>`` classes the way fully_shard builds ``FSDP<Name>``, with its
own class cache and the original class at MRO index 3, so an ``abc.ABC`` head fails the same way.
Each claim is checked patched (the default) and with FSDP_AUTOPATCH=0, which must bring torch's
TypeError back: that is what shows this test can fail. replicate_with_fsdp is imported before
FSDP2 and transformers, after transformers alone (it then imports FSDP2 from inside its own
import), after both, and after both from a worker thread.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import LAYOUT_ERROR, environment, json_lines, layout_bug_here, run_python

from fsdp_autopatch import _matrix

pytestmark = pytest.mark.slow

ABC_HEAD = "token-classification"  # Qwen2ForTokenClassification: GenericForTokenClassification(ABC)
PLAIN = "causal-lm"  # Qwen2ForCausalLM: no ABC anywhere in its MRO

# The imports of each order, before anything else runs.
IMPORTS = {
    "replicate-first": """
import torch.distributed._composable.replicate_with_fsdp
import transformers
""",
    # replicate_with_fsdp imports FSDP2 itself, from inside its own import.
    "transformers-first": """
import transformers
import torch.distributed._composable.replicate_with_fsdp
""",
    # The order of a training script that imports its libraries first.
    "replicate-last": """
import torch.distributed.fsdp, transformers
import torch.distributed._composable.replicate_with_fsdp
""",
    # As replicate-last, with replicate_with_fsdp imported by a worker thread.
    "replicate-in-thread": """
import importlib, threading
import torch.distributed.fsdp, transformers
worker = threading.Thread(target=importlib.import_module,
                          args=("torch.distributed._composable.replicate_with_fsdp",))
worker.start()
worker.join()
""",
}
ORDERS = list(IMPORTS)
# The orders that begin as tests/prepared.py does (FSDP2, then transformers): their cases run in
# a child of the prepared interpreter; the others in a fresh one.
PREPARED_ORDERS = ("replicate-last", "replicate-in-thread")

# One rank: replicate every decoder layer and the root, train next to an unsharded copy, and
# print one JSON line per model after the patch's status line.
REPLICATE_AND_TRAIN = """
import abc, copy, json, sys
import torch
import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
import fsdp_autopatch
from fsdp_autopatch import _verify

mesh = _verify.init_process_group()
print(json.dumps({"status": fsdp_autopatch.status().to_dict()}), flush=True)
for kind in sys.argv[1:]:
    model = _verify.build_model(kind)
    original = type(model)
    reference = copy.deepcopy(model)
    result = {"model": kind, "abc_in_mro": abc.ABC in original.__mro__}
    try:
        for layer in model.base_model.layers:
            replicate(layer, mesh=mesh)
        replicate(model, mesh=mesh)
    except TypeError as error:
        result.update(replicated=False, error=str(error))
        print(json.dumps(result), flush=True)
        continue
    losses = {model: [], reference: []}
    optimizers = {net: torch.optim.SGD(net.parameters(), lr=0.1) for net in losses}
    for step in range(2):
        for net, optimizer in optimizers.items():
            loss = net(**_verify.make_batch(kind, step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[net].append(loss.item())
    wrapper = type(model)
    result.update(
        replicated=True,
        wrapper=_verify.describe_class(wrapper),
        upstream_bases=wrapper.__bases__ == (ReplicateModule, original),
        is_replicate_module=isinstance(model, ReplicateModule),
        original_at_mro_3=wrapper.__mro__[3] is original,
        layer_wrapper=type(model.base_model.layers[0]).__name__,
        max_loss_difference=max(abs(a - b) for a, b in zip(losses[model], losses[reference])),
    )
    print(json.dumps(result), flush=True)
dist.destroy_process_group()
"""


def replicate_and_train(order: str, **env: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The patch's status and, per model, what replicate() and a train step did."""
    code = f"import sys; sys.argv[1:] = {[ABC_HEAD, PLAIN]!r}\n{IMPORTS[order]}{REPLICATE_AND_TRAIN}"
    result = run_python(code, env=environment(**env), prepared=order in PREPARED_ORDERS)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = json_lines(result.stdout)
    (status,) = [line["status"] for line in lines if "status" in line]
    return status, {line["model"]: line for line in lines if "model" in line}


@pytest.fixture(scope="module")
def replicate_builds_classes(real_torch: dict[str, str]) -> None:
    if not _matrix.REPLICATE_ROW.covers(_matrix.release(real_torch["torch"])):
        pytest.skip(f"torch {real_torch['torch']}: replicate() builds Replicate<Name> classes only on "
                    f"torch {_matrix.REPLICATE_ROW.versions}")


@pytest.fixture(scope="module", params=ORDERS)
def order(request: pytest.FixtureRequest, replicate_builds_classes: None) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def unpatched(order: str) -> dict[str, dict[str, Any]]:
    status, results = replicate_and_train(order, FSDP_AUTOPATCH="0")
    assert status["applied"] is False
    return results


def assert_trains_like_unreplicated(result: dict[str, Any]) -> None:
    assert result["replicated"], result.get("error")
    assert result["is_replicate_module"] and result["original_at_mro_3"]
    assert result["layer_wrapper"] == "ReplicateQwen2DecoderLayer"
    assert result["max_loss_difference"] < 1e-5


def test_replicate_trains_abc_headed_and_plain_models(
    order: str, unpatched: dict[str, dict[str, Any]]
) -> None:
    status, patched = replicate_and_train(order)
    assert unpatched[ABC_HEAD]["abc_in_mro"] is True
    assert_trains_like_unreplicated(unpatched[PLAIN])
    assert "unpatched" not in status["reason"], status["reason"]
    if not layout_bug_here():
        # This torch and Python accept torch's own class: the patch stands aside.
        assert status["applied"] is False, status
        assert_trains_like_unreplicated(unpatched[ABC_HEAD])
        assert_trains_like_unreplicated(patched[ABC_HEAD])
        assert patched[ABC_HEAD]["upstream_bases"] is True
        return
    assert status["applied"] is True, status
    assert "torch.distributed._composable.replicate_with_fsdp.replicate" in status["sites"], status["sites"]

    # Without the patch, the ABC head fails exactly as fully_shard does; the plain model does not.
    assert unpatched[ABC_HEAD]["replicated"] is False
    assert LAYOUT_ERROR in unpatched[ABC_HEAD]["error"]

    assert_trains_like_unreplicated(patched[ABC_HEAD])
    assert patched[ABC_HEAD]["upstream_bases"] is False
    # The plain model gets torch's own class, bit for bit.
    assert_trains_like_unreplicated(patched[PLAIN])
    assert patched[PLAIN]["upstream_bases"] is True
    assert patched[PLAIN]["wrapper"] == unpatched[PLAIN]["wrapper"]


MONKEYPATCHED = """
import abc, json
import torch.distributed.fsdp, transformers
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from fsdp_autopatch import _verify

class Plain(nn.Linear):
    pass

class Head(abc.ABC, nn.Linear):
    pass

mesh = _verify.init_process_group()
modules = []
for cls in (Plain, Head):
    module = cls(4, 4)
    try:
        replicate(module, mesh=mesh)
        modules.append(module)
    except TypeError as error:
        modules.append(None)

def calls():
    answers = []
    for module in modules:
        if module is None:
            answers.append("not replicated")
            continue
        answer = module.reshard()
        answers.append(answer if isinstance(answer, str) else "torch's reshard")
    return answers

real = FSDPModule.__dict__["reshard"]
report = {"before": calls()}
ReplicateModule.reshard = lambda self: "replicate's " + type(self).__name__  # a name it did not define
report["added"] = calls()
FSDPModule.reshard = lambda self: "fsdp's " + type(self).__name__
report["both"] = calls()
del ReplicateModule.reshard
report["removed"] = calls()
FSDPModule.reshard = real
report["restored"] = calls()
print(json.dumps(report))
"""


def test_monkeypatches_of_replicatemodule_reach_abc_modules_as_they_reach_others(
    replicate_builds_classes: None,
) -> None:
    result = run_python(MONKEYPATCHED, prepared=True)
    assert result.returncode == 0, result.stderr[-4000:]
    (report,) = json_lines(result.stdout)
    assert report == {
        "before": ["torch's reshard"] * 2,
        "added": ["replicate's ReplicatePlain", "replicate's ReplicateHead"],
        "both": ["replicate's ReplicatePlain", "replicate's ReplicateHead"],
        "removed": ["fsdp's ReplicatePlain", "fsdp's ReplicateHead"],
        "restored": ["torch's reshard"] * 2,
    }, report
    alone = run_python(MONKEYPATCHED, env=environment(FSDP_AUTOPATCH="0"), prepared=True)
    assert alone.returncode == 0, alone.stderr[-4000:]
    (report,) = json_lines(alone.stdout)
    assert report["added"] == ["replicate's ReplicatePlain",
                               "not replicated" if layout_bug_here() else "replicate's ReplicateHead"]
