"""What the package left in a fresh interpreter after the imports named, for
tests/test_startup.py: its modules and wrapt's, whether it is armed, its watchers on
sys.meta_path. One JSON line.

    python tests/programs/startup_state.py [--finder ahead|behind] [IMPORTS]  # IMPORTS: import_order.py's

``--finder``: tests/programs/delegating_finder.py's finder goes in first, before any import.
"""

import json
import sys

args = sys.argv[1:]
if args[:1] == ["--finder"]:
    import delegating_finder

    delegating_finder.install(args[1])
    args = args[2:]
if args:
    from import_order import import_modules

    import_modules(args[0])
state = {
    "ours": sorted(m for m in sys.modules if m.startswith(("fsdp_autopatch", "wrapt"))),
    "armed": getattr(sys.modules.get("fsdp_autopatch"), "armed", None),
    "watchers": [type(f).__name__ for f in sys.meta_path if "fsdp_autopatch" in type(f).__module__],
}
print(json.dumps(state))
