"""What ``fsdp-autopatch verify`` prints, read and checked for the tests: tests/test_readme.py
runs the README's two verify commands (patched, and with FSDP_AUTOPATCH=0) and checks them here;
tests/test_cli.py reads its other runs with the same helpers.
"""

from __future__ import annotations

import subprocess

from harness import AFFECTED

from fsdp_autopatch import _verify

ALL_TRAINED = "OK: 8 of 8 runs wrapped (FSDP2 fully_shard, composable DDP replicate) and trained"
# The classes _verify's tiny Qwen2 models are made of, per head.
HEAD_CLASSES = {"token-classification": "Qwen2ForTokenClassification",
                "sequence-classification": "Qwen2ForSequenceClassification",
                "question-answering": "Qwen2ForQuestionAnswering"}
TABLE_HEADER = ["model", "result", "seconds"]


def result_of(row: str, run: str) -> str:
    """The result column of verify's table row for ``run`` (a run's name may hold a space)."""
    assert row.startswith(f"{run} "), (row, run)
    return " ".join(row[len(run):].split()[:-1])


def classes_shown(stdout: str) -> list[str]:
    """The per-rank class lines verify prints between its table and its verdict."""
    rows = stdout.splitlines()
    start = rows.index("classes the patch built, per rank:")
    return [row.strip() for row in rows[start + 1 : -1]]


def table_and_after(stdout: str) -> list[str]:
    """verify's lines from its table's header on (what a command before it printed is dropped)."""
    rows = stdout.splitlines()
    (start,) = [index for index, row in enumerate(rows) if row.split() == TABLE_HEADER]
    return rows[start:]


def assert_verify_shows_the_fix(
    fixed: subprocess.CompletedProcess[str], broken: subprocess.CompletedProcess[str], bug: bool
) -> None:
    """``verify`` patched shards and trains every model; with FSDP_AUTOPATCH=0 the heads fail with
    the layout error where this torch and Python have the bug (``bug``), and nothing breaks where
    they do not."""
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    rows = table_and_after(fixed.stdout)
    runs = _verify.runs((*AFFECTED, "causal-lm"))  # each with fully_shard, then with composable DDP
    assert [result_of(row, run) for row, run in zip(rows[1:9], runs)] == ["sharded"] * 8
    assert "[8/8] causal-lm (DDP): sharded" in fixed.stderr
    # The patch is not installed at all: no class goes through a patched site.
    assert classes_shown(broken.stdout) == [
        "rank 0: no class went through a patched site (the patch was not applied)"]
    if not bug:
        # CPython accepts torch's classes: the patch stands aside, and nothing breaks without it.
        assert rows[-1].startswith(f"{ALL_TRAINED}; no patch was needed")
        assert "patch not applied: " in fixed.stderr
        assert broken.returncode == 0, broken.stdout + broken.stderr
        return
    assert rows[-1].startswith(f"{ALL_TRAINED}; the patch was applied")
    assert "patch applied: " in fixed.stderr
    # Each head got a class built on abc.ABC at each site; the decoder layer and the causal LM
    # kept torch's.
    assert classes_shown(fixed.stdout) == [
        *(f"rank 0: {name} -> {prefix}{name} on abc.ABC" for prefix in ("FSDP", "DDP")
          for name in HEAD_CLASSES.values()),
        "rank 0: torch's own class kept for 3: FSDPQwen2DecoderLayer, FSDPQwen2ForCausalLM, "
        "DDPQwen2ForCausalLM"]

    assert broken.returncode == 1, broken.stdout + broken.stderr
    rows = table_and_after(broken.stdout)
    expected = (["layout error"] * 3 + ["sharded"]) * 2
    assert [result_of(row, run) for row, run in zip(rows[1:9], runs)] == expected
    assert rows[-1].startswith(
        "FAIL: 6 of 8 runs cannot be used with FSDP2 or DDP (token-classification: __class__ assignment: ")
    assert rows[-1].endswith("the patch was not applied: disabled by FSDP_AUTOPATCH=0; unset FSDP_AUTOPATCH "
                             "to let the patch run")
