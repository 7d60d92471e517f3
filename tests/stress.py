"""A pytest plugin: the ``stress`` mark on the longest loops, named here in one table.

``nox -s tests`` runs everything but them (``-m "not stress"``), so that the default run stays
short; ``nox -s stress`` runs only them, and CI runs both. A name here that its module no longer
defines is an error, so a renamed test cannot drop out of both sessions unnoticed.
"""

from __future__ import annotations

import pytest

# module file name: test functions whose repetitions are the point (races, pip life cycles).
STRESS = {
    # 50 (and 10) fresh interpreters, each racing 16 threads through the first imports.
    "test_concurrency.py": (
        "test_threaded_first_imports_install_once", "test_threaded_first_imports_refuse_once",
    ),
    # pip install, reinstall, upgrade, downgrade and uninstall in fresh venvs, wheels built twice.
    "test_uninstall.py": (
        "test_reinstall_and_upgrade_keep_one_start_up_line", "test_uninstall_leaves_nothing",
    ),
    # A venv with pip, then pip install -e and uninstall: the same life cycle, from the sources.
    "test_packaging.py": ("test_editable_install_arms_and_uninstalls_cleanly",),
}


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    checked = set()
    for item in items:
        module = getattr(item, "module", None)
        names = STRESS.get(item.path.name, ())
        if module is None or not names:
            continue
        if item.path.name not in checked:
            checked.add(item.path.name)
            missing = [name for name in names if not hasattr(module, name)]
            if missing:
                raise pytest.UsageError(f"tests/stress.py names {missing} in {item.path.name}, which has no "
                                        "such test; update its STRESS table")
        if getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.stress)
