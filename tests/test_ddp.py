"""Composable DDP's ``replicate`` (``torch.distributed._composable.replicate``) with the installed
patch, on real torch and transformers, in fresh interpreters on a gloo CPU group.

``replicate`` builds ``DDP<Name>(DDP, cls)`` inline, a new class on every call, so an ``abc.ABC``
head fails there exactly as under ``fully_shard``. Each claim is checked patched and with
``FSDP_AUTOPATCH=0``, which must bring torch's TypeError back (or, where this CPython accepts
torch's class, show the patch standing aside). The import orders include a DDP-only process,
which never imports FSDP2, and one that imports composable DDP from a worker thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import LAYOUT_ERROR, PROGRAMS, ci_tier, environment, json_lines, layout_bug_here, run_program
from harness import AFFECTED, RANKS, torchrun
from import_order import THREAD, spec

from fsdp_autopatch import DDP_MODULE, _matrix, _sites
from fsdp_autopatch._verify import DDP_SUFFIX

pytestmark = pytest.mark.slow

PLAIN = "causal-lm"
DDP_SITE = f"{DDP_MODULE}.replicate"

# The imports of each order, before anything else runs (tests/programs/import_order.py).
IMPORTS = {
    # A DDP-only training script: composable DDP and transformers, never FSDP2.
    "ddp-only": (DDP_MODULE, "transformers"),
    "transformers-first": ("transformers", DDP_MODULE),
    # FSDP2 imports composable DDP itself (torch 2.6+).
    "after-fsdp2": ("torch.distributed.fsdp", "transformers"),
    "ddp-in-thread": ("transformers", THREAD + DDP_MODULE),
}

def replicate_and_train(
    order: str, runs: tuple[str, ...], **env: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The status line (and whether FSDP2 was imported), and each run's result."""
    # after-fsdp2 begins as tests/programs/prepared.py does: its cases run in a child of the prepared
    # interpreter, the other orders in a fresh one.
    result = run_program(PROGRAMS / "ddp_train.py", spec(*IMPORTS[order]), *runs, env=environment(**env),
                         prepared=order == "after-fsdp2")
    lines = json_lines(result.stdout)
    (head,) = [line for line in lines if "status" in line]
    return head, {line["model"]: line for line in lines if "model" in line}


def assert_trains_like_the_unreplicated_copy(result: dict[str, Any]) -> None:
    assert result["sharded"], result.get("error")
    assert result["is_fsdp_module"] and result["original_at_mro_2"]
    assert result["trained"] and result["max_loss_difference"] == 0.0, result


@pytest.fixture(scope="module")
def ddp_in_rows(real_torch: dict[str, str]) -> None:
    if not _sites.sites_of(_sites.DDP_REPLICATE, _matrix.release(real_torch["torch"])):
        pytest.skip(f"torch {real_torch['torch']} has no composable DDP site in fsdp_autopatch/_sites.py")


# The prepared order in the README's tests; every other in CI's tier.
PREPARED_ORDER = "after-fsdp2"


@pytest.mark.parametrize("order", [*ci_tier(*(order for order in IMPORTS if order != PREPARED_ORDER)),
                                   PREPARED_ORDER])
def test_replicate_trains_the_affected_heads_and_a_plain_model(order: str, ddp_in_rows: None) -> None:
    runs = tuple(kind + DDP_SUFFIX for kind in (*AFFECTED, PLAIN))
    head, patched = replicate_and_train(order, runs)
    off_head, unpatched = replicate_and_train(order, runs, FSDP_AUTOPATCH="0")
    status = head["status"]
    if order in ("ddp-only", "transformers-first", "ddp-in-thread"):
        assert head["fsdp2_imported"] is False and off_head["fsdp2_imported"] is False
    assert off_head["status"]["applied"] is False
    plain = PLAIN + DDP_SUFFIX
    for results in (patched, unpatched):
        assert_trains_like_the_unreplicated_copy(results[plain])
        assert results[plain]["upstream_bases"] is True
    # The plain model gets torch's own class, patched or not.
    assert patched[plain]["wrapper"] == unpatched[plain]["wrapper"]
    if not layout_bug_here():
        assert status["applied"] is False, status
        for kind in AFFECTED:
            assert_trains_like_the_unreplicated_copy(patched[kind + DDP_SUFFIX])
        return
    assert status["applied"] is True and DDP_SITE in status["sites"], status
    for kind in AFFECTED:
        run = kind + DDP_SUFFIX
        assert unpatched[run]["sharded"] is False and LAYOUT_ERROR in unpatched[run]["error"]
        assert_trains_like_the_unreplicated_copy(patched[run])
        assert patched[run]["upstream_bases"] is False


@pytest.mark.ci_tier  # fully_shard's in the README's tests (tests/test_fully_shard.py)
@pytest.mark.parametrize("order", ["ddp-only", "after-fsdp2"])
def test_users_own_abc_and_generic_modules_under_force(order: str, ddp_in_rows: None) -> None:
    """``FSDP_AUTOPATCH=force`` for a user's ``class Head(abc.ABC, nn.Module)`` and a
    ``Generic[T]``-first module, with no transformers; a plain module gets a new torch class on
    each call, as torch builds it."""
    imports = spec(*(name for name in IMPORTS[order] if name != "transformers"))
    reports = {}
    for mode in ("force", "0"):
        result = run_program(PROGRAMS / "ddp_users_own.py", imports, env=environment(FSDP_AUTOPATCH=mode))
        (reports[mode],) = json_lines(result.stdout)
    forced, off = reports["force"], reports["0"]
    # Generic[T]-first is refused even by CPython 3.15; ABC-first where the layout bug is.
    assert LAYOUT_ERROR in off["GenericHead"][0]
    assert (LAYOUT_ERROR in str(off["Head"][0])) is layout_bug_here()
    assert forced["Head"][0][0] == "DDPHead" and forced["GenericHead"][0][0] == "DDPGenericHead"
    assert DDP_SITE in forced["status"]["sites"]
    for report in (forced, off):
        (first, first_id), (second, second_id) = report["Plain"]
        assert first == second == "DDPPlain" and first_id != second_id, "one new class per call"


@pytest.mark.ci_tier
def test_two_ranks_under_torchrun(tmp_path: Path, ddp_in_rows: None) -> None:
    """Two gloo ranks replicate the ABC head and the plain model and train exactly like the
    unreplicated copy; without the patch the head fails on both ranks."""
    runs = ["token-classification" + DDP_SUFFIX, PLAIN + DDP_SUFFIX]
    results = {}
    for mode in (None, "0"):
        done = torchrun(PROGRAMS / "ddp_train.py", spec(*IMPORTS["ddp-only"]), *runs,
                        env=environment(FSDP_AUTOPATCH=mode), cwd=tmp_path, timeout=600)
        results[mode] = {(line["rank"], line["model"]): line for line in json_lines(done.stdout)
                         if "model" in line}
    for rank in range(RANKS):
        assert_trains_like_the_unreplicated_copy(results[None][(rank, runs[0])])
        assert_trains_like_the_unreplicated_copy(results[None][(rank, runs[1])])
        assert_trains_like_the_unreplicated_copy(results["0"][(rank, runs[1])])
        head = results["0"][(rank, runs[0])]
        assert (not head["sharded"] and LAYOUT_ERROR in head["error"]) is layout_bug_here()
