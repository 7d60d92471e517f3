"""The "Works with" table (docs/works-with.md), rendered from what the stacks tests showed.

The stacks tests' conftest calls :func:`publish` after the run. The table goes between the
``<!-- stacks:start -->`` and ``<!-- stacks:end -->`` markers of docs/works-with.md only when
``FSDP_AUTOPATCH_STACKS_DOCS=1`` is set and every row was run (the ``stacks`` nox session with
``-- --docs``); otherwise it is written to a file in the temporary directory, and the page is
left alone. To render a saved run again::

    python tests/stacks/readme_table.py RESULTS.json [--docs]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# Where the table goes, and the variable that asks for it there (the older name still counts).
DOCUMENT = ROOT / "docs" / "works-with.md"
DOCS_VARIABLES = ("FSDP_AUTOPATCH_STACKS_DOCS", "FSDP_AUTOPATCH_STACKS_README")
START, END = "<!-- stacks:start -->", "<!-- stacks:end -->"


@dataclass(frozen=True)
class Row:
    framework: str
    package: str  # whose installed version the row names
    exercised: str
    test: str  # "<module>.py::<function>", relative to tests/stacks/


ROWS = (
    Row("accelerate", "accelerate",
        "its own FSDP2 preparation (`Accelerator.prepare` → `_prepare_fsdp2` → `fsdp2_prepare_model`) "
        "of a sequence-classification reward model, 3 AdamW steps, `get_state_dict` (full), "
        "`save_model`, reload with `from_pretrained`. accelerate never selects FSDP on a CPU (it "
        "silently uses DDP), so the test sets `distributed_type` to FSDP before `prepare()`, "
        "which is what it does on GPUs",
        "test_accelerate.py::test_accelerate_fsdp2_prepares_trains_saves_and_reloads"),
    Row("TRL", "trl",
        "`RewardTrainer` on an in-memory preference dataset through accelerate's FSDP2 path "
        "(reached on a CPU as above), `save_model`, reload with `from_pretrained`",
        "test_trl.py::test_reward_trainer_trains_saves_and_reloads"),
    Row("PEFT", "peft",
        "LoRA on a sequence-classification model; the `PeftModel`'s decoder layers and the "
        "`PeftModel` itself sharded, trained, adapter weights gathered",
        "test_peft.py::test_lora_reward_model_sharded_as_peft_users_shard_it"),
    Row("verl", "verl",
        "its own `fsdp_utils.apply_fsdp2` on a critic (token classification) and a reward model "
        "(sequence classification), trained; with verl's `maybe_patch_fsdp_module` replaced by a "
        "no-op (the package alone) and as shipped (both)",
        "test_verl.py::test_apply_fsdp2_critic_and_reward_model"),
    Row("verl", "verl",
        "a user's value head, `class Head(ABC, nn.Module)` or `class Head(Generic[T], nn.Module)`, "
        "inside a causal LM and sharded as its own unit by `apply_fsdp2`, trained",
        "test_verl.py::test_non_root_abc_module"),
    Row("Ray", "ray",
        "two actors of a local Ray cluster (started by the raylet; each sets `RANK` and `LOCAL_RANK` "
        "in `__init__`, as verl and OpenRLHF do) form a gloo group and shard a sequence-classification "
        "reward model with FSDP2, trained; then `runtime_env={\"env_vars\": {\"FSDP_AUTOPATCH\": \"0\"}}`; "
        "then wrapt missing on the actors",
        "test_ray.py::test_ray_actors_shard_and_train_an_affected_head"),
    Row("torch.distributed.checkpoint", "torch",
        "`dcp.save` / `dcp.load` of a sharded reward model's model and AdamW state into a model "
        "built from other weights",
        "test_torch_stacks.py::test_dcp_round_trip_restores_model_and_optimizer"),
    Row("meta-device init", "torch",
        "model built on `meta`, `fully_shard`, `to_empty`, full state dict broadcast from rank 0, "
        "rotary `inv_freq` recomputed, 2 AdamW steps",
        "test_torch_stacks.py::test_meta_device_init_then_train"),
    Row("torch.compile", "torch",
        "a sharded reward model compiled with the `eager` and `aot_eager` backends, 2 AdamW steps",
        "test_torch_stacks.py::test_compile_matches_eager"),
)

# Met with or without this package (each fails the same way on transformers 4.55.3, which has no
# bug): worth a line to whoever shards these models on these versions.
TRAPS = (
    "accelerate never runs FSDP on a CPU, and says nothing of it: `fsdp_version=2` plugins and "
    "`accelerate launch --use_fsdp` wrap the model in DDP there (1.10.1) or leave each process "
    "an undistributed copy (1.16.0, `DistributedType.NO`).",
    "TRL's `RewardConfig` defaults to `bf16=True`, which fails on a CPU: pass `bf16=False`.",
    "`Trainer.save_model()` writes no weights under accelerate's FSDP2 default "
    "`SHARDED_STATE_DICT`: set `FSDP_STATE_DICT_TYPE=FULL_STATE_DICT`.",
    "Activation checkpointing fails with Qwen2's default `use_cache=True`: set `use_cache=False`.",
    "`CPUOffloadPolicy` needs an accelerator.",
    "After `to_empty()`, rotary `inv_freq` buffers hold garbage: recompute them.",
    "Sharding a PEFT model's inner transformers model on its own bypasses FSDP's hooks, because "
    "PEFT's `BaseTuner.forward` calls `self.model.forward`: shard the `PeftModel` (its layers, then "
    "itself).",
    "Sharded and unsharded critics or reward models agree exactly only with "
    "`classifier_dropout=0.0` (verl sets it).",
)


def function_line(test: str) -> Optional[int]:
    """Line of the test function, for a link that lands on it."""
    module, _, function = test.partition("::")
    try:
        tree = ast.parse((HERE / module).read_text())
    except OSError:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function:
            return node.lineno
    return None


def row_results(row: Row, results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every recorded result of the row's test, its parameters included."""
    wanted = f"tests/stacks/{row.test}"
    return [entry for nodeid, entry in sorted(results.items())
            if nodeid == wanted or nodeid.startswith(wanted + "[")]


def summarise(entries: list[dict[str, Any]], key: str) -> str:
    if not entries:
        return "not run"
    failed = [entry for entry in entries if entry["outcome"] != "passed"]
    if failed:
        return f"test {failed[0]['outcome']}"
    texts = list(dict.fromkeys(entry.get(key, "") for entry in entries if entry.get(key)))
    return "; ".join(texts) or "passed"


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def describe_run(tests: dict[str, dict[str, Any]], seconds: Optional[float]) -> dict[str, Any]:
    """A run as saved and rendered: where and when it ran, how long, what each test showed.
    Read here, in the environment the ranks ran in, so that re-rendering elsewhere is faithful."""
    return {
        "stamp": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "seconds": seconds,
        "versions": {row.package: version(row.package) for row in ROWS} | {
            "transformers": version("transformers")},
        "tests": tests,
    }


def render(run: dict[str, Any]) -> str:
    tests, versions, seconds = run["tests"], run["versions"], run.get("seconds")
    took = f", {len(tests)} tests in {seconds / 60:.0f} min on {run['cores']} cores" if seconds else ""
    lines = [
        f"Generated by `nox -f tests/noxfile.py -s stacks -- --docs` on {run['stamp']}: Python "
        f"{run['python']}, torch {versions['torch']} (CPU), transformers {versions['transformers']}, "
        f"2 gloo ranks on a CPU, tiny Qwen2 models built from configs{took}. Do not edit by hand.",
        "",
        "Every case runs twice on 2 ranks under `torchrun`, so the installed start-up file is what "
        "patches each rank: with fsdp-autopatch as installed, and with `FSDP_AUTOPATCH=0`. "
        "CI runs the cases marked `stacks_ci` (`nox -f tests/noxfile.py -s stacks -- ci`: "
        "accelerate, torch.distributed.checkpoint, torch.compile); the whole session, which "
        "installs verl and its dependencies, runs on request.",
        "",
        "| framework | version | exercised | with fsdp-autopatch | with `FSDP_AUTOPATCH=0` | test |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in ROWS:
        entries = row_results(row, tests)
        module, _, function = row.test.partition("::")
        line = function_line(row.test)
        # Relative to docs/, where the table is.
        link = f"[`{function}`](../tests/stacks/{module}{f'#L{line}' if line else ''})"
        lines.append(
            f"| {row.framework} | {versions.get(row.package, '?')} | {cell(row.exercised)} | "
            f"{cell(summarise(entries, 'with_patch'))} | {cell(summarise(entries, 'without_patch'))} | "
            f"{link} |"
        )
    lines += [
        "",
        "Traps on these versions that have nothing to do with the layout bug: they show the same "
        "with or without fsdp-autopatch, and on transformers 4.55.3, which has no ABC heads:",
        "",
        *[f"- {trap}" for trap in TRAPS],
    ]
    return "\n".join(lines) + "\n"


def complete(tests: dict[str, dict[str, Any]]) -> bool:
    return all(row_results(row, tests) for row in ROWS)


def publish(run: dict[str, Any], docs: Optional[bool] = None) -> str:
    """Write the table: into docs/works-with.md when asked for and every row ran, else to a
    temporary file next to the run it came from (``results.json``). Returns where it went."""
    text = render(run)
    # A directory of its own, made by mkdtemp (mode 0700): a fixed name in a shared temporary
    # directory could be another user's, or a link planted there.
    out = Path(tempfile.mkdtemp(prefix="fsdp-autopatch-stacks-"))
    (out / "results.json").write_text(json.dumps(run, indent=1, sort_keys=True))
    if docs is None:
        docs = any(os.environ.get(name, "") not in ("", "0") for name in DOCS_VARIABLES)
    if docs and complete(run["tests"]):
        sys.path.insert(0, str(HERE.parent))
        from harness import replace_section

        if replace_section(START, END, text, DOCUMENT):
            return str(DOCUMENT)
    (out / "table.md").write_text(text)
    if docs:
        return f"{out / 'table.md'} ({DOCUMENT.name} left alone: not every row was run)"
    return str(out / "table.md")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="results.json written by a stacks run")
    parser.add_argument("--docs", "--readme", dest="docs", action="store_true",
                        help="write the table into docs/works-with.md")
    options = parser.parse_args(argv)
    print(publish(json.loads(options.results.read_text()), docs=options.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
