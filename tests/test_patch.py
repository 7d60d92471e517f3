"""The parts of ``_patch`` that need no torch: the list of classes the status shows, and the
bytecode reading behind the self-check. The sites themselves are exercised on real torch in
test_fully_shard.py, test_hooks.py and test_replicate.py."""

from __future__ import annotations

import threading

from fsdp_autopatch import _patch


def record(index: int) -> _patch.ClassRecord:
    return _patch.ClassRecord(f"Block{index}", "user.model", "site", f"FSDPBlock{index}", "torch")


def test_class_records_keep_the_first_ones_and_count_all_from_many_threads() -> None:
    records = _patch.ClassRecords(limit=10)
    start = threading.Barrier(8)

    def add(thread: int) -> None:
        start.wait()
        for index in range(100):
            records.add(record(thread * 100 + index))

    threads = [threading.Thread(target=add, args=(thread,)) for thread in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    kept, seen = records.snapshot()
    assert seen == 800 and len(kept) == 10 and len(set(kept)) == 10


CACHE: dict[type, type] = {}


def reads_the_cache(cls: type) -> object:
    return CACHE.get(cls)


def reads_another(cls: type) -> object:
    return {}.get(cls)


def shadows_it(CACHE: dict[type, type], cls: type) -> object:
    return CACHE.get(cls)


def test_reads_global_finds_loads_of_the_global_only() -> None:
    assert _patch.reads_global(reads_the_cache, "CACHE")
    assert not _patch.reads_global(reads_another, "CACHE")
    assert not _patch.reads_global(shadows_it, "CACHE")  # a parameter of that name is no global
    assert not _patch.reads_global(len, "CACHE")  # no bytecode to read
