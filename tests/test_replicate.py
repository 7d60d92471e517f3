"""replicate() (``torch.distributed._composable.replicate_with_fsdp``, on the torch releases of
``_sites``' FSDP2 replicate rows) with the installed patch, on real torch and transformers, in fresh
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
from conftest import LAYOUT_ERROR, PROGRAMS, ci_tier, environment, json_lines, layout_bug_here, run_program
from import_order import THREAD, spec

from fsdp_autopatch import _matrix, _sites

pytestmark = pytest.mark.slow

ABC_HEAD = "token-classification"  # Qwen2ForTokenClassification: GenericForTokenClassification(ABC)
PLAIN = "causal-lm"  # Qwen2ForCausalLM: no ABC anywhere in its MRO

# The imports of each order, before anything else runs.
REPLICATE = "torch.distributed._composable.replicate_with_fsdp"
IMPORTS = {
    "replicate-first": (REPLICATE, "transformers"),
    # replicate_with_fsdp imports FSDP2 itself, from inside its own import.
    "transformers-first": ("transformers", REPLICATE),
    # The order of a training script that imports its libraries first.
    "replicate-last": ("torch.distributed.fsdp", "transformers", REPLICATE),
    # As replicate-last, with replicate_with_fsdp imported by a worker thread.
    "replicate-in-thread": ("torch.distributed.fsdp", "transformers", THREAD + REPLICATE),
}
ORDERS = list(IMPORTS)
# The orders that begin as tests/programs/prepared.py does (FSDP2, then transformers): their cases run in
# a child of the prepared interpreter; the others in a fresh one.
PREPARED_ORDERS = ("replicate-last", "replicate-in-thread")

# One rank: replicate every decoder layer and the root, train next to an unsharded copy, and
# print one JSON line per model after the patch's status line.


def replicate_and_train(order: str, **env: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The patch's status and, per model, what replicate() and a train step did."""
    result = run_program(PROGRAMS / "replicate_train.py", spec(*IMPORTS[order]), ABC_HEAD, PLAIN,
                         env=environment(**env), prepared=order in PREPARED_ORDERS)
    lines = json_lines(result.stdout)
    (status,) = [line["status"] for line in lines if "status" in line]
    return status, {line["model"]: line for line in lines if "model" in line}


@pytest.fixture(scope="module")
def replicate_builds_classes(real_torch: dict[str, str]) -> None:
    if not _sites.sites_of(_sites.FSDP2_REPLICATE, _matrix.release(real_torch["torch"])):
        pytest.skip(f"torch {real_torch['torch']}: replicate() builds Replicate<Name> classes only from "
                    "torch 2.9 on")


# A prepared order in the README's tests; every other in CI's tier.
@pytest.fixture(scope="module", params=[*ci_tier(*(order for order in ORDERS if order != PREPARED_ORDERS[0])),
                                        PREPARED_ORDERS[0]])
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




def test_monkeypatches_of_replicatemodule_reach_abc_modules_as_they_reach_others(
    replicate_builds_classes: None,
) -> None:
    result = run_program(PROGRAMS / "replicate_monkeypatched.py", prepared=True)
    (report,) = json_lines(result.stdout)
    assert report == {
        "before": ["torch's reshard"] * 2,
        "added": ["replicate's ReplicatePlain", "replicate's ReplicateHead"],
        "both": ["replicate's ReplicatePlain", "replicate's ReplicateHead"],
        "removed": ["fsdp's ReplicatePlain", "fsdp's ReplicateHead"],
        "restored": ["torch's reshard"] * 2,
    }, report
    alone = run_program(PROGRAMS / "replicate_monkeypatched.py", env=environment(FSDP_AUTOPATCH="0"),
                        prepared=True)
    (report,) = json_lines(alone.stdout)
    assert report["added"] == ["replicate's ReplicatePlain",
                               "not replicated" if layout_bug_here() else "replicate's ReplicateHead"]
