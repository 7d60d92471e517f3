"""Measure what installing fsdp-autopatch costs, side by side with the alternatives.

    python benchmarks/run.py                      # full run; results to a temporary directory
    python benchmarks/run.py --quick              # proves the benchmarks run (CI); numbers mean little
    python benchmarks/run.py --python .venv/bin/python --venvs ../bench-venvs   # reuse environments
    python benchmarks/run.py --results DIR        # results.json (every sample) and results.md to DIR
    python benchmarks/run.py --update-docs        # full run; the table into docs/cost.md and the
                                                  # summary into benchmarks/results/
    python benchmarks/run.py --docs-from benchmarks/results/results.md  # table only, no run

Exit status 1 when a measurement could not be taken; timing targets are reported, never enforced.
See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
# tests/harness.py holds the helpers the benchmarks share with the tests and the matrix.
sys.path.insert(0, str(HERE.parent / "tests"))

import bench_envs  # noqa: E402
import bench_report  # noqa: E402
from bench_harness import (  # noqa: E402
    Command,
    MeasurementError,
    Ratio,
    alternate,
    importtime,
    loaded_modules,
    pairwise_ratio,
    run_checked,
    wall_seconds,
)
from harness import TORCH_PIN, TRANSFORMERS_PIN, build_wheel, portable_command, portable_path  # noqa: E402
from harness import scrubbed_environment as clean_environment  # noqa: E402

TORCH_CHILD = HERE / "bench_torch.py"
TORCH_ONLY = "import torch"
TRAINING_IMPORT = "import torch.distributed.fsdp, transformers"
# What --update-docs keeps in the checkout: the table and the summary behind it.
COMMITTED_RESULTS = HERE / "results"
OFF = {"FSDP_AUTOPATCH": "0"}
Row = dict[str, str]


@dataclass(frozen=True)
class Settings:
    startup_rounds: int  # alternated `python -c pass` runs per environment
    startup_importtime_runs: int
    import_rounds: int  # alternated training-script imports per side
    import_warmup: int
    import_importtime_runs: int
    shard_rounds: int  # rounds of fresh processes (patched, disabled, patched mixed kinds)
    shard_reps: int  # fresh models per kind per process
    shard_steps: int  # timed train steps per model
    class_instances: int
    class_models: int
    first_trip_rounds: int  # alternated pairs of processes, patched and disabled
    first_trip_classes: int  # new classes sharded per process


FULL = Settings(startup_rounds=300, startup_importtime_runs=30, import_rounds=15, import_warmup=1,
                import_importtime_runs=3,
                shard_rounds=8, shard_reps=3, shard_steps=20, class_instances=64, class_models=8,
                first_trip_rounds=8, first_trip_classes=40)
QUICK = Settings(startup_rounds=15, startup_importtime_runs=3, import_rounds=1, import_warmup=0,
                 import_importtime_runs=1,
                 shard_rounds=1, shard_reps=1, shard_steps=3, class_instances=8, class_models=2,
                 first_trip_rounds=1, first_trip_classes=4)


def ratio_met(ratio: Ratio, target: str) -> str:
    """Targets are judged, never asserted. "within noise": the 95% interval holds 1.00; "no extra
    cost": its low end is at or below 1.00; "≤ x": the median is, and "inconclusive" when the
    median is above x but the interval still reaches it."""
    change = f"{(ratio.median - 1) * 100:+.1f}%"
    if target == "within noise" or target.startswith("1.00"):
        return "yes" if ratio.within_noise else f"no ({change})"
    if target.startswith("no extra"):
        return "yes" if ratio.low <= 1.0 else f"no ({change})"
    if target.startswith("≤ "):
        limit = float(target[2:])
        if ratio.median <= limit:
            return "yes"
        return f"inconclusive ({change})" if ratio.low <= limit else f"no ({change})"
    return "-"


def comparison_row(name: str, a: list[float], b: list[float], target: str) -> tuple[Row, dict[str, Any]]:
    ratio = pairwise_ratio(b, a)
    a_median, b_median = statistics.median(a), statistics.median(b)
    data = {"a_median_s": a_median, "b_median_s": b_median, "ratio": ratio.to_dict(), "a_s": a, "b_s": b}
    row = {
        "benchmark": name,
        "a": bench_report.format_seconds(a_median),
        "b": bench_report.format_seconds(b_median),
        "delta": bench_report.format_delta(b_median - a_median),
        "ratio": bench_report.format_ratio(ratio.to_dict()),
        "target": target,
        "met": ratio_met(ratio, target),
    }
    return row, data


def module_names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(f"`{name}`" for name in names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


def startup(envs: dict[str, str], settings: Settings, cwd: str) -> tuple[list[Row], dict[str, Any]]:
    """`python -c pass` in the same venv without the package, with it, with a naive .pth, and with
    a .pth that imports a one-line module (the floor of any .pth import)."""
    env = clean_environment()
    commands = {label: Command((python, "-c", "pass"), env, cwd) for label, python in envs.items()}
    modules = {label: loaded_modules(python, "pass", env, cwd) for label, python in envs.items()}
    extras = {label: sorted(modules[label] - modules["without"]) for label in envs if label != "without"}
    profiles = alternate({label: (lambda c=command: importtime(c)) for label, command in commands.items()},
                         rounds=settings.startup_importtime_runs)
    # Modules that never go through the import system (none expected) have no line, hence 0.
    extra_us = {label: [sum(run.get(name, 0) for name in extras[label]) for run in profiles[label]]
                for label in extras}
    walls = alternate({label: (lambda c=command: wall_seconds(c)) for label, command in commands.items()},
                      rounds=settings.startup_rounds, warmup=3)
    rows: list[Row] = []
    data: dict[str, Any] = {"extra_modules": extras, "extra_import_us": extra_us}
    for label, name, target in (
        ("package", "start-up `python -c pass`: with fsdp-autopatch (B) vs without (A)", "within noise"),
        ("naive", "start-up `python -c pass`: naive `.pth` importing wrapt (B) vs without (A)", "-"),
    ):
        row, data[f"wall_{label}"] = comparison_row(name, walls["without"], walls[label], target)
        rows.append(row)
    for label, name, module_target in (
        ("package", "start-up, fsdp-autopatch", 3),
        ("naive", "start-up, naive `.pth`", None),
    ):
        count, micros = len(extras[label]), statistics.median(extra_us[label])
        rows.append({
            "benchmark": f"{name}: extra modules imported",
            "a": "0", "b": f"{count}: {module_names(extras[label])}" if count else "0",
            "target": f"≤ {module_target}" if module_target else "-",
            "met": ("yes" if count <= module_target else "no") if module_target else "-",
        })
        rows.append({
            "benchmark": f"{name}: their import time (`-X importtime`, self)",
            "a": "0", "b": bench_report.format_seconds(micros / 1e6),
            "delta": "+" + bench_report.format_seconds(micros / 1e6),
            "target": "-", "met": "-",  # judged against the one-line module's, below
        })
    # The package's start-up module against the floor any .pth import pays on this machine, run
    # by run: what the package's own code adds.
    row, data["import_vs_one_line"] = comparison_row(
        "start-up import time (`-X importtime`, self): `fsdp_autopatch` (B) vs a one-line module a `.pth` "
        "imports (A)", [us / 1e6 for us in extra_us["one-line"]], [us / 1e6 for us in extra_us["package"]],
        "≤ 2")
    rows.append(row)
    return rows, data


def torch_import(python: str, settings: Settings, cwd: str) -> tuple[list[Row], dict[str, Any]]:
    """`import torch` alone, in a process that never imports FSDP2 or transformers: the start-up
    watcher must load nothing beyond what start-up itself loaded, and cost nothing measurable."""
    default, off = clean_environment(), clean_environment(**OFF)
    commands = {"off": Command((python, "-c", TORCH_ONLY), off, cwd),
                "default": Command((python, "-c", TORCH_ONLY), default, cwd)}
    at_startup = loaded_modules(python, "pass", default, cwd) - loaded_modules(python, "pass", off, cwd)
    with_torch = {"off": loaded_modules(python, TORCH_ONLY, off, cwd),
                  "default": loaded_modules(python, TORCH_ONLY, default, cwd)}
    extras = sorted(with_torch["default"] - with_torch["off"] - at_startup)
    walls = alternate({label: (lambda c=command: wall_seconds(c)) for label, command in commands.items()},
                      rounds=settings.import_rounds, warmup=settings.import_warmup)
    row, wall = comparison_row(f"`{TORCH_ONLY}` alone: default (B) vs `FSDP_AUTOPATCH=0` (A)",
                               walls["off"], walls["default"], "within noise")
    rows = [row, {
        "benchmark": f"… extra modules imported by `{TORCH_ONLY}`, beyond the start-up module",
        "a": "0", "b": f"{len(extras)}: {module_names(extras)}" if extras else "0",
        "target": "0", "met": "yes" if not extras else "no",
    }]
    return rows, {"wall": wall, "extra_modules": extras, "loaded_at_startup": sorted(at_startup)}


def training_import(python: str, settings: Settings, cwd: str) -> tuple[list[Row], dict[str, Any]]:
    """The training script's own imports, patch armed (default) vs switched off."""
    default, off = clean_environment(), clean_environment(**OFF)
    commands = {"off": Command((python, "-c", TRAINING_IMPORT), off, cwd),
                "default": Command((python, "-c", TRAINING_IMPORT), default, cwd)}
    modules = {"off": loaded_modules(python, TRAINING_IMPORT, off, cwd),
               "default": loaded_modules(python, TRAINING_IMPORT, default, cwd)}
    extras = sorted(modules["default"] - modules["off"])
    profiles = [importtime(commands["default"]) for _ in range(settings.import_importtime_runs)]
    extra_us = [sum(run.get(name, 0) for name in extras) for run in profiles]
    walls = alternate({label: (lambda c=command: wall_seconds(c)) for label, command in commands.items()},
                      rounds=settings.import_rounds, warmup=settings.import_warmup)
    row, wall = comparison_row(f"`{TRAINING_IMPORT}`: default (B) vs `FSDP_AUTOPATCH=0` (A)",
                               walls["off"], walls["default"], "≤ 1.01")
    micros = statistics.median(extra_us)
    rows = [row, {
        "benchmark": "… extra modules imported by default, and their import time",
        "a": "0", "b": f"{len(extras)} modules, {bench_report.format_seconds(micros / 1e6)}",
        "delta": f"+{bench_report.format_seconds(micros / 1e6)}", "target": "-", "met": "-",
    }]
    return rows, {"wall": wall, "extra_modules": extras, "extra_import_us": extra_us,
                  "only_when_off": sorted(modules["off"] - modules["default"])}


def torch_child(python: str, cwd: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    result = run_checked(Command((python, str(TORCH_CHILD), *args), env, cwd))
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise MeasurementError(f"bench_torch.py {' '.join(args)} printed no result")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def expect_status(output: dict[str, Any], applied: bool, what: str) -> None:
    """A "patched" number from an unpatched process (or the reverse) is no measurement."""
    status = output["status"]
    if status["applied"] is not applied:
        raise MeasurementError(f"{what}: expected the patch {'applied' if applied else 'off'}, "
                               f"status says: {status['reason']}")


def sharding(python: str, settings: Settings, cwd: str) -> tuple[list[Row], dict[str, Any]]:
    """fully_shard and train-step times, from fresh processes alternated round by round.

    "patched" and "disabled" run the same workload (causal LM only), so their only difference
    is the switch. "mixed" interleaves the causal LM with ABC-headed models in one patched
    process, so those comparisons are paired repetition by repetition.
    """
    work = ("--reps", str(settings.shard_reps), "--steps", str(settings.shard_steps))
    mixed_kinds = "causal-lm,abc-causal-lm,token-classification"

    def child(env: dict[str, str], kinds: str) -> Callable[[], dict[str, Any]]:
        return lambda: torch_child(python, cwd, env, "shard", "--kinds", kinds, *work)

    runs = {
        "patched": child(clean_environment(), "causal-lm"),
        "disabled": child(clean_environment(**OFF), "causal-lm"),
        "mixed": child(clean_environment(), mixed_kinds),
    }
    outputs = alternate(runs, rounds=settings.shard_rounds, warmup=0)
    for label, applied in (("patched", True), ("disabled", False), ("mixed", True)):
        for output in outputs[label]:
            expect_status(output, applied, f"{label} sharding run")

    def series(label: str, kind: str, measure: str) -> list[float]:
        """Per repetition when both sides come from the same processes (paired in time); per
        process (its median) when they come from different ones, so that each ratio is one
        independent pair of processes and the interval is not made narrower than it is."""
        values = [output["result"][kind][measure] for output in outputs[label]]
        if label == "mixed":
            return [value for per_process in values for value in per_process]
        return [statistics.median(per_process) for per_process in values]

    token_abc = all(output["result"]["token-classification"]["abc_in_mro"] for output in outputs["mixed"])
    token_name = "Qwen2ForTokenClassification" + (" (ABC head in this transformers)" if token_abc else
                                                  " (no ABC head in this transformers)")
    rows: list[Row] = []
    data: dict[str, Any] = {"token_classification_has_abc": token_abc}
    abc_lm = "the causal LM with an ABC head mixed in (B) vs the causal LM (A), patched"
    for key, name, a, b, target in (
        ("shard_causal", "`fully_shard`, Qwen2ForCausalLM: patched (B) vs `FSDP_AUTOPATCH=0` (A)",
         ("disabled", "causal-lm", "shard"), ("patched", "causal-lm", "shard"), "1.00 within noise"),
        ("step_causal", "train step, Qwen2ForCausalLM: patched (B) vs `FSDP_AUTOPATCH=0` (A)",
         ("disabled", "causal-lm", "step"), ("patched", "causal-lm", "step"), "1.00 within noise"),
        ("shard_abc", f"`fully_shard`: {abc_lm}",
         ("mixed", "causal-lm", "shard"), ("mixed", "abc-causal-lm", "shard"), "no extra cost"),
        ("step_abc", f"train step: {abc_lm}",
         ("mixed", "causal-lm", "step"), ("mixed", "abc-causal-lm", "step"), "no extra cost"),
        ("shard_token", f"`fully_shard`: {token_name} (B) vs Qwen2ForCausalLM (A), patched",
         ("mixed", "causal-lm", "shard"), ("mixed", "token-classification", "shard"), "- (other head)"),
        ("step_token", f"train step: {token_name} (B) vs Qwen2ForCausalLM (A), patched",
         ("mixed", "causal-lm", "step"), ("mixed", "token-classification", "step"), "- (other head)"),
    ):
        row, data[key] = comparison_row(name, series(*a), series(*b), target)
        rows.append(row)
    data["versions"] = {"torch": outputs["patched"][0]["torch"],
                        "transformers": outputs["patched"][0]["transformers"]}
    data["status"] = outputs["patched"][0]["status"]
    return rows, data


def classes(python: str, settings: Settings, cwd: str) -> tuple[list[Row], dict[str, Any]]:
    output = torch_child(python, cwd, clean_environment(), "classes",
                         "--instances", str(settings.class_instances), "--models", str(settings.class_models))
    expect_status(output, True, "class construction run")
    rows: list[Row] = []
    for report in output["result"].values():
        if not isinstance(report, dict):
            continue
        built = max(report["max_wrapper_classes_per_original"],
                    report["max_wrapper_classes_in_existence_per_original"],
                    report["max_cache_entries_per_original"])
        originals = len(report["original_classes"])
        rows.append({
            "benchmark": (f"class construction: {report['modules_sharded']} modules of "
                          f"{', '.join(report['original_classes'])} sharded"
                          + (" (ABC)" if report["abc_in_mro"] else "")),
            "a": f"{originals} original class{'es' if originals > 1 else ''}",
            "b": f"{built} FSDP class{'es' if built != 1 else ''} per original class",
            "target": "1 per original class",
            "met": "yes" if built == 1 else "no",
        })
    return rows, output


def first_trip(python: str, settings: Settings, cwd: str) -> tuple[list[Row], dict[str, Any]]:
    """The first fully_shard of a new class, patched against ``FSDP_AUTOPATCH=0``, from fresh
    processes alternated round by round; each ratio is one pair of processes (their medians)."""
    work = ("first-trip", "--classes", str(settings.first_trip_classes))
    runs = {label: (lambda env=env: torch_child(python, cwd, env, *work))
            for label, env in (("patched", clean_environment()), ("disabled", clean_environment(**OFF)))}
    outputs = alternate(runs, rounds=settings.first_trip_rounds, warmup=0)
    for label, applied in (("patched", True), ("disabled", False)):
        for output in outputs[label]:
            expect_status(output, applied, f"{label} first-trip run")

    def medians(label: str, kind: str) -> list[float]:
        return [statistics.median(output["result"][kind]) for output in outputs[label]]

    plain_row, plain = comparison_row(
        "`fully_shard`, a plain class's first trip through the site: patched (B) vs `FSDP_AUTOPATCH=0` (A)",
        medians("disabled", "plain"), medians("patched", "plain"), "1.00 within noise")
    # Inside the patched processes, class by class: what building the compatible class costs.
    abc_row, abc_data = comparison_row(
        "`fully_shard`, an ABC class's first trip (B) vs a plain class's (A), patched",
        [value for output in outputs["patched"] for value in output["result"]["plain"]],
        [value for output in outputs["patched"] for value in output["result"]["abc"]],
        "- (builds a class)")
    builder_row, builder = comparison_row(
        "FSDP2's builder, a class that needs the fix (B) vs its `ABC`-last twin (A), patched",
        [value for output in outputs["patched"] for value in output["result"]["builder twin"]],
        [value for output in outputs["patched"] for value in output["result"]["builder abc"]], "≤ 5")
    shadowed_row, shadowed = comparison_row(
        "`getattr` of a method the module's class shadows (`reshard`), a class that needs the fix (B) "
        "vs its `ABC`-last twin (A), patched",
        [value for output in outputs["patched"] for value in output["result"]["shadowed twin"]],
        [value for output in outputs["patched"] for value in output["result"]["shadowed abc"]], "≤ 2")
    rows = [plain_row, abc_row, builder_row, shadowed_row]
    return rows, {"plain": plain, "abc": abc_data, "builder": builder, "shadowed": shadowed}


def measure(name: str, errors: list[str], results: dict[str, Any], rows: list[Row],
            run: Callable[[], tuple[list[Row], dict[str, Any]]]) -> None:
    """Run one benchmark; a failure is recorded and the others still run."""
    bench_envs.log(f"measuring {name}")
    try:
        new_rows, data = run()
    except Exception as error:
        errors.append(f"{name}: {type(error).__name__}: {error}")
        traceback.print_exc()
        return
    rows.extend(new_rows)
    results[name] = data


def torch_python(options: argparse.Namespace, work: Path, wheel: Path) -> str:
    if options.python:
        if not bench_envs.has_torch_stack(options.python):
            raise MeasurementError(f"{options.python} lacks torch, transformers, wrapt or the installed "
                                   "fsdp_autopatch.pth")
        return str(options.python)
    if bench_envs.has_torch_stack(sys.executable):
        return sys.executable
    return str(bench_envs.ensure_venv(work / "torch", (*bench_envs.TORCH_REQUIREMENTS, "wrapt"), wheel))


def package_versions(python: str) -> dict[str, Optional[str]]:
    code = ("import json, sys\nfrom importlib import metadata\nv = {}\n"
            "for n in ('torch', 'transformers', 'wrapt', 'fsdp-autopatch'):\n"
            "    try: v[n] = metadata.version(n)\n    except Exception: v[n] = None\n"
            "v['python'] = sys.version.split()[0]\nprint(json.dumps(v))")
    return json.loads(run_checked(Command((python, "-c", code), clean_environment(), "/")).stdout)  # type: ignore[no-any-return]


def run_all(options: argparse.Namespace, settings: Settings, work: Path) -> dict[str, Any]:
    errors: list[str] = []
    rows: list[Row] = []
    results: dict[str, Any] = {}
    cwd = str(work)  # children start away from the checkout, so its sources never shadow the install
    bench_envs.log("building the fsdp-autopatch wheel from the checkout")
    wheel = build_wheel(work / "dist")
    envs = {
        "without": str(bench_envs.ensure_venv(work / "startup-without", ("wrapt",))),
        "package": str(bench_envs.ensure_venv(work / "startup-package", ("wrapt",), wheel)),
        "naive": str(bench_envs.ensure_venv(work / "startup-naive", ("wrapt",), naive_pth=True)),
        "one-line": str(bench_envs.ensure_venv(work / "startup-one-line", ("wrapt",), one_line_pth=True)),
    }
    versions: dict[str, Any] = {"startup envs": package_versions(envs["package"])}
    measure("startup", errors, results, rows, lambda: startup(envs, settings, cwd))
    try:
        python = torch_python(options, work, wheel)
        versions["torch env"] = package_versions(python)
    except Exception as error:
        errors.append(f"torch environment: {type(error).__name__}: {error}")
        python = None
    if python is not None:
        measure("torch_import", errors, results, rows, lambda: torch_import(python, settings, cwd))
        measure("training_import", errors, results, rows, lambda: training_import(python, settings, cwd))
        measure("sharding", errors, results, rows, lambda: sharding(python, settings, cwd))
        measure("classes", errors, results, rows, lambda: classes(python, settings, cwd))
        measure("first_trip", errors, results, rows, lambda: first_trip(python, settings, cwd))
    startup_v, torch_v = versions["startup envs"], versions.get("torch env", {})
    return {
        "meta": {
            # Paths as a reader elsewhere can follow them: relative to the checkout, or .venv/...
            "command": portable_command(["python", *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "quick": options.quick,
            "settings": asdict(settings),
            "machine": bench_report.machine(),
            "versions": {
                "Python": startup_v.get("python"),
                "fsdp-autopatch": f"{startup_v.get('fsdp-autopatch')} ({bench_report.git_revision()})",
                "wrapt": startup_v.get("wrapt"),
                "torch": torch_v.get("torch"),
                "transformers": torch_v.get("transformers"),
                # Shown only when it differs from the start-up environments' Python.
                "Python (torch env)": None if torch_v.get("python") == startup_v.get("python")
                else torch_v.get("python"),
            },
        },
        "rows": rows,
        "errors": errors,
        "benchmarks": results,
    }


def write_results(directory: Path, results: dict[str, Any], table: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (directory / "results.md").write_text(table)


def summary(value: Any) -> Any:
    """``value`` without its lists of numbers (the samples): what a reader of the committed
    results needs is the table's provenance, medians and ratios, not every timing."""
    if isinstance(value, dict):
        return {key: summary(item) for key, item in value.items()
                if not (isinstance(item, list) and item and all(isinstance(x, (int, float)) for x in item))}
    if isinstance(value, list):
        return [summary(item) for item in value]
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="few repetitions: only proves that every benchmark still runs")
    # abspath, not resolve(): a venv's python is a symlink to an interpreter outside the venv,
    # and the benchmarks run their children from a directory outside the checkout.
    parser.add_argument("--python", type=os.path.abspath,
                        help="interpreter with torch, transformers and fsdp-autopatch installed "
                        "(default: this one if it has them, else a venv built with torch "
                        f"{TORCH_PIN} and transformers {TRANSFORMERS_PIN})")
    parser.add_argument("--venvs", type=Path, help="keep the benchmark venvs in this directory and reuse "
                        "them next time (default: a temporary directory, removed afterwards)")
    parser.add_argument("--results", type=Path, metavar="DIR",
                        help="write results.json (every sample) and results.md to DIR (default: a new "
                        "temporary directory, named at the end)")
    # --update-readme and --readme-from: their names from when the table was in README.md.
    parser.add_argument("--update-docs", "--update-readme", dest="update_docs", action="store_true",
                        help="write the table between the benchmark markers of docs/cost.md, and the table "
                        "and a summary without samples to benchmarks/results/")
    parser.add_argument("--docs-from", "--readme-from", dest="docs_from", type=Path, metavar="RESULTS_MD",
                        help="only write this results.md into docs/cost.md; measure nothing")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    options = parse(argv)
    if options.docs_from:
        bench_report.update_docs(options.docs_from.read_text())
        return 0
    if options.update_docs and options.quick:
        print("--update-docs is not taken with --quick: quick numbers are not for publishing")
        return 2
    settings = QUICK if options.quick else FULL
    work = options.venvs or Path(tempfile.mkdtemp(prefix="fsdp-autopatch-bench-"))
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = run_all(options, settings, work)
    finally:
        if options.venvs is None:
            shutil.rmtree(work, ignore_errors=True)
    # Nothing in the checkout changes unless asked: a run's samples go to a temporary place.
    output = options.results or Path(tempfile.mkdtemp(prefix="fsdp-autopatch-results-"))
    table = bench_report.markdown(results)
    write_results(output, results, table)
    print(table)
    print(f"results written to {output}/results.json and results.md")
    if options.update_docs:
        write_results(COMMITTED_RESULTS, summary(results), table)
        bench_report.update_docs(table)
        print(f"{portable_path(str(bench_report.DOCUMENT))} and "
              f"{portable_path(str(COMMITTED_RESULTS))}/ updated")
    for error in results["errors"]:
        print(f"could not measure: {error.splitlines()[0]}", file=sys.stderr)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
