"""``status()`` before and around the decision: what it says it waits for, and that it never
waits for what is already imported or cannot come.

Fast: throwaway environments whose torch and transformers are stand-ins written by the test
(``conftest.fake_torch``: tests/stand_in/). Claims about ``fully_shard`` itself are in
test_fully_shard.py, on real torch.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import (
    PROGRAMS,
    Throwaway,
    abc_swap_refused,
    fake_torch,
    fake_transformers,
    json_lines,
    make_throwaway,
    write_module,
)

import fsdp_autopatch
from fsdp_autopatch import DDP_MODULE, _sites

# What the hooks wait for: the first import of any wrapper they patch, as the table names them.
WRAPPERS = f"{', '.join(_sites.APIS[:-1])} or {_sites.APIS[-1]}"

STATUS = "import json, fsdp_autopatch; print(json.dumps(fsdp_autopatch.status().to_dict()))"


def status_after(
    env: Throwaway, imports: str, mode: Optional[str] = None, stderr: str = ""
) -> dict[str, Any]:
    result = env.run(f"{imports}\n{STATUS}", FSDP_AUTOPATCH=mode)
    assert (result.returncode, result.stderr) == (0, stderr), result.stderr
    (status,) = json_lines(result.stdout)
    return status


@pytest.fixture
def env(tmp_path: Path, installed: Path) -> Throwaway:
    venv = make_throwaway(tmp_path / "venv", installed)
    fake_transformers(venv.site_packages)
    return venv


def torch_version(env: Throwaway, version: str) -> None:
    fake_torch(env.site_packages, version=version)


@pytest.mark.parametrize(("imports", "mode", "reason"), [
    ("import transformers", None, f"waiting for {WRAPPERS} to be imported"),
    ("import torch", None, f"armed: waiting for the first import of {WRAPPERS} or transformers"),
    ("import torch; import fsdp_autopatch; fsdp_autopatch.apply()", None,
     f"waiting for {WRAPPERS} and transformers to be imported"),
    ("import torch; import fsdp_autopatch; fsdp_autopatch.apply()", "force",
     f"waiting for {WRAPPERS} to be imported"),
])
def test_waiting_names_only_what_is_not_imported(
    env: Throwaway, imports: str, mode: Optional[str], reason: str
) -> None:
    torch_version(env, "2.13.0")
    assert status_after(env, imports, mode)["reason"] == reason


def private_fsdp2(env: Throwaway) -> None:
    """A torch whose FSDP2 lives only in a new private module that torch.distributed.fsdp does
    not re-export."""
    torch_version(env, "2.16.0")
    shutil.rmtree(env.site_packages / "torch" / "distributed" / "fsdp")
    write_module(env.site_packages, "torch.distributed.fsdp._fsdp2_v2",
                 "def fully_shard(module):\n    pass\n")


@pytest.mark.parametrize("mode", [None, "force"])
def test_fsdp2_where_the_package_does_not_look_is_said_not_waited_for(
    env: Throwaway, mode: Optional[str]
) -> None:
    private_fsdp2(env)
    unknown = (f"torch 2.16.0's FSDP2 layout is unknown to fsdp-autopatch {fsdp_autopatch.__version__} (none "
               "of the class-construction sites it patches is there)")
    # torch 2.16 is newer than the version rows, and composable DDP's site, probed, refuses an ABC
    # module (forced, the bug is assumed): the user reads why FSDP2 is not fixed, once. Where
    # CPython accepts the ABC swap (3.15+), the bug is not here, and nothing is said unless forced.
    said = f"fsdp-autopatch: cannot fix FSDP2 fully_shard's layout bug for ABC modules here: {unknown} " \
           "(upgrade fsdp-autopatch)\n" if mode == "force" or abc_swap_refused() else ""
    status = status_after(env, "import torch.distributed.fsdp._fsdp2_v2, transformers", mode, said)
    assert status["applied"] is False
    assert f"FSDP2 fully_shard runs unpatched: {unknown}" in status["reason"], status
    assert status["torch"] == "2.16.0" and status["transformers"] == "4.55.2"


def test_fsdp1_of_torch_2_5_waits_for_its_fsdp2_package(env: Throwaway) -> None:
    """torch 2.4 and 2.5 keep FSDP2 in torch.distributed._composable.fsdp; their
    torch.distributed.fsdp is FSDP1, which has no layout bug to fix."""
    torch_version(env, "2.5.1")
    shutil.rmtree(env.site_packages / "torch" / "distributed" / "fsdp")
    write_module(env.site_packages, "torch.distributed.fsdp", "class FullyShardedDataParallel:\n    pass\n")
    status = status_after(env, "import torch.distributed.fsdp, transformers")
    assert status["reason"] == f"waiting for {WRAPPERS} to be imported"


def test_torch_without_fsdp2_is_decided(env: Throwaway) -> None:
    torch_version(env, "2.3.1")
    status = status_after(env, "import torch.distributed.fsdp, transformers")
    assert status["applied"] is False
    assert status["reason"].startswith("torch 2.3.1 has no FSDP2 (")
    assert status["reason"].endswith("nothing to patch")


def test_a_type_rebound_in_torchs_builders_is_named_not_waited_for(env: Throwaway) -> None:
    """Both wrappers imported, each builder's ``type`` the user's before the install: the status
    names the decision and each binding, never "waiting for" what is imported."""
    torch_version(env, "2.13.0")
    result = env.run_program(PROGRAMS / "rebound_type.py")
    (status,) = json_lines(result.stdout)
    assert not status["applied"] and "waiting" not in status["reason"], status["reason"]
    bound = ("type is <function logging_type at 0x", ">, not the builtin: bound before fsdp-autopatch "
             "installed; remove that binding, or call torch's own")
    for api, module in (("FSDP2 fully_shard", "torch.distributed.fsdp._fully_shard._fsdp_init"),
                        ("composable DDP replicate", "torch.distributed._composable.replicate")):
        assert f"; {api} runs unpatched: {module}.{bound[0]}" in status["reason"]
    assert status["reason"].count(bound[1]) == 2
    # The decision is the version rows' (no site of this torch could be run), and the user reads
    # the first cause where the rows show the bug.
    assert status["decided_by"] == "matrix"
    said = [line for line in result.stderr.splitlines() if line.startswith("fsdp-autopatch: ")]
    assert len(said) == (1 if status["in_matrix"] else 0)
    start = ("fsdp-autopatch: cannot fix FSDP2 fully_shard's layout bug for ABC modules here: "
             "torch.distributed.fsdp._fully_shard._fsdp_init.type is ")
    assert all(line.startswith(start) for line in said)


@pytest.mark.parametrize("mode", [None, "force"])
def test_a_site_cpython_accepts_for_abc_is_left_to_torch_unless_forced(
    env: Throwaway, mode: Optional[str]
) -> None:
    """Where CPython accepts torch's own class for an ABC module (CPython 3.15, and here a DDP
    wrapper that sits on abc.ABC itself), auto mode leaves the site to torch. Forced, it is
    patched: a Generic[T]-first module, which CPython refuses on every version, is wrapped."""
    fake_torch(env.site_packages)
    replicate = env.site_packages / "torch" / "distributed" / "_composable" / "replicate.py"
    replicate.write_text("import abc\n" + replicate.read_text().replace("class DDP:", "class DDP(abc.ABC):"))
    result = env.run_program(PROGRAMS / "accepted_site.py", FSDP_AUTOPATCH=mode)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    (report,) = json_lines(result.stdout)
    if mode == "force":
        assert report["status"]["sites"] == [f"{DDP_MODULE}.replicate"], report["status"]
        assert report["outcome"] == "DDPGenericHead"
    else:
        status = report["status"]
        assert status["applied"] is False and "accepts" in status["reason"], status
        assert "object layout differs" in report["outcome"]
