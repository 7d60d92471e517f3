"""A finder that asks every other finder on sys.meta_path, as some import tools and test
frameworks do: the start-up watcher, asked by it in turn, must not ask it back.

    import delegating_finder; delegating_finder.install("ahead")   # or "behind" the watcher
"""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec
from typing import Any, Optional, Sequence


class Delegating:
    def find_spec(self, name: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[ModuleSpec]:
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    return spec
        return None


def install(position: str) -> None:
    """Put a Delegating finder "ahead" of the start-up watcher or "behind" it (first where no
    watcher is armed)."""
    watcher = [i for i, f in enumerate(sys.meta_path) if type(f).__name__ == "FirstImportWatcher"]
    offset = 0 if position == "ahead" else 1
    sys.meta_path.insert(watcher[0] + offset if watcher else 0, Delegating())
