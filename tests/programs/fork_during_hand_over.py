"""A child forked while a thread of the parent holds the start-up watcher's lock (its hand-over
to the hooks, stretched), for tests/test_faults.py: the child must arm on its own. One JSON line:
the child's exit code (0: armed) and whether the parent armed.

    python tests/programs/fork_during_hand_over.py
"""

import json
import os
import signal
import sys
import threading
import warnings

import fsdp_autopatch

warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() of a process with threads
watcher = next((f for f in sys.meta_path if type(f).__name__ == 'FirstImportWatcher'), None)
register_hooks = fsdp_autopatch.register_hooks
entered, release = threading.Event(), threading.Event()


def slow_register_hooks():
    # wrapt's 60-80 ms import, stretched: the hand-over holds the watcher's lock meanwhile.
    entered.set()
    release.wait()
    register_hooks()


fsdp_autopatch.register_hooks = slow_register_hooks
thread = threading.Thread(target=watcher.hand_over, daemon=True)
thread.start()
entered.wait()
pid = os.fork()
if pid == 0:
    fsdp_autopatch.register_hooks = register_hooks
    signal.alarm(30)  # a child waiting on the parent's lock dies of SIGALRM
    import torch.distributed.fsdp  # noqa: F401 (the import that arms)
    armed = "wrapt" in sys.modules and "fsdp_autopatch._hooks" in sys.modules
    os._exit(0 if armed and watcher not in sys.meta_path else 3)
_, code = os.waitpid(pid, 0)
release.set()
thread.join()
print(json.dumps({"child": os.waitstatus_to_exitcode(code), "parent_armed": "wrapt" in sys.modules}))
